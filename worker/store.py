"""Expert files on one or more store folders (one per drive): what is there and intact. A bad
file is reported, never deleted, so the check itself loses no copy of an expert."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidInput, ShoalError
from engine.manifest import MANIFEST_NAME, ExpertKey, Manifest, read_manifest
from worker.uncached import sha256_uncached

Copy = tuple[int, Path]  # (index of the store folder, i.e. the drive; the file in it)


@dataclass(frozen=True)
class StoreScan:
    """The verified expert files found in a worker's store folders."""

    manifest: Manifest
    folders: tuple[Path, ...]
    held: dict[ExpertKey, Path]  # (layer, expert) -> a verified file (the first copy)
    problems: tuple[str, ...]  # human-readable: corrupt or unreadable files, with their paths
    copies: dict[ExpertKey, tuple[Copy, ...]]  # every verified copy, one per store folder

    def expert_bytes(self) -> int:
        """Bytes of all distinct experts held (one copy of each)."""
        sizes = {(e.layer, e.expert): e.bytes for e in self.manifest.experts}
        return sum(sizes[key] for key in self.held)


# Every file is checked against the manifest's checksum before it is served (read around the OS
# page cache, so the check does not fill memory); every intact copy is kept, since a worker
# reads from all its drives.
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
    copies: dict[ExpertKey, list[Copy]] = {}
    problems: list[str] = []
    for drive, (folder, _) in enumerate(manifests):
        for entry in manifest.experts:
            path = folder / entry.file
            if not path.exists():
                continue
            problem = _check_file(path, entry.bytes, entry.sha256 if verify else None)
            if problem:
                problems.append(problem)
            else:
                copies.setdefault((entry.layer, entry.expert), []).append((drive, path))
    held = {key: found[0][1] for key, found in sorted(copies.items())}
    return StoreScan(
        manifest, tuple(f for f, _ in manifests), held, tuple(problems),
        {key: tuple(found) for key, found in sorted(copies.items())},
    )


def free_disk(folders: tuple[Path, ...]) -> int:
    """Free bytes on the drives of the store folders, each drive counted once."""
    free: dict[int, int] = {}
    for folder in folders:
        try:
            free.setdefault(folder.stat().st_dev, shutil.disk_usage(folder).free)
        except OSError:
            continue  # a drive that went away has no free space to offer
    return sum(free.values())


def _check_file(path: Path, size: int, sha256: str | None) -> str | None:
    try:
        actual = path.stat().st_size
        if actual != size:
            return f"{path}: {actual} bytes, the manifest says {size}; not served"
        if sha256 is not None and sha256_uncached(path, size) != sha256:
            return f"{path}: checksum does not match the manifest; not served"
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror}); not served"
    return None


def check_store_folder(folder: Path) -> None:
    """Refuse a folder above the stores: the folder `shoal shard` wrote (OUT), given for one
    of its stores (OUT/worker-K), or the folder holding OUT; either would serve nothing."""
    if not folder.exists():
        raise ShoalError(f"--store {folder} does not exist")
    if any(folder.glob("L*/E*.safetensors")):
        return
    stores = store_folders_under(folder)
    if stores:
        names = ", ".join(str(p) for p in stores)
        what = ("the folder `shoal shard` wrote" if (folder / "dense").is_dir()
                else "a folder above the stores `shoal shard` wrote")
        raise ShoalError(
            f"{folder} is {what}, not a store folder: the stores in it are {names}. Give "
            "--store with the one meant for this machine (each Mac serves its own)"
        )


def store_folders_under(folder: Path) -> list[Path]:
    """The store folders (a manifest, no dense part) one or two levels under `folder`."""
    found = [*folder.glob("*/" + MANIFEST_NAME), *folder.glob("*/*/" + MANIFEST_NAME)]
    return sorted(p.parent for p in found
                  if p.parent.name != "dense" and not (p.parent / "dense").is_dir())
