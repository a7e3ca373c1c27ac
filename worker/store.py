"""Expert files on one or more store folders (one per drive): what is there and intact.

A store folder holds the model's manifest and some expert files. Every file is checked
against the manifest's checksum before it is served; a bad file is reported, never
deleted, so no copy of an expert is lost by the check itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.checkpoint import Manifest, read_manifest, sha256_file
from engine.errors import InvalidInput, ShoalError

ExpertKey = tuple[int, int]


@dataclass(frozen=True)
class StoreScan:
    """The verified expert files found in a worker's store folders."""

    manifest: Manifest
    folders: tuple[Path, ...]
    held: dict[ExpertKey, Path]  # (layer, expert) -> a verified file
    problems: tuple[str, ...]  # human-readable: corrupt or unreadable files, with their paths


def scan_stores(folders: list[Path], *, verify: bool = True) -> StoreScan:
    """Read the manifests of all store folders and find every intact expert file in them."""
    if not folders:
        raise InvalidInput("give at least one --store folder")
    manifests = [(Path(f), read_manifest(Path(f))) for f in folders]
    first_folder, manifest = manifests[0]
    for folder, other in manifests[1:]:
        if other.fingerprint != manifest.fingerprint:
            raise ShoalError(
                f"store folders hold different models: {first_folder} has "
                f"{manifest.fingerprint[:12]}, {folder} has {other.fingerprint[:12]}"
            )
    held: dict[ExpertKey, Path] = {}
    problems: list[str] = []
    for folder, _ in manifests:
        for entry in manifest.experts:
            key = (entry.layer, entry.expert)
            path = folder / entry.file
            if key in held or not path.exists():
                continue
            problem = _check_file(path, entry.bytes, entry.sha256 if verify else None)
            if problem:
                problems.append(problem)
            else:
                held[key] = path
    return StoreScan(manifest, tuple(f for f, _ in manifests), held, tuple(problems))


def _check_file(path: Path, size: int, sha256: str | None) -> str | None:
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{path}: {actual} bytes, the manifest says {size}; not served"
        if sha256 is not None and sha256_file(path) != sha256:
            return f"{path}: checksum does not match the manifest; not served"
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror}); not served"
    return None


def read_expert(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except (OSError, RuntimeError, ValueError) as e:
        raise ShoalError(f"cannot read expert file {path}: {e}") from None
