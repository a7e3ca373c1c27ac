"""The manifest: what a sharded model holds (config, MoE layers, every expert file and its
checksums), written by `shoal shard` and trusted by both sides, with the helpers that write and
check those files; it imports neither mlx nor mlx-lm."""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from engine.errors import CorruptData, InvalidInput, NotFound

ExpertKey = tuple[int, int]  # (layer, expert): one routed expert of the model

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "shoal-manifest"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class MoeLayer:
    """One MoE block's routed experts: where its switch module sits and what it holds."""

    layer: int
    path: str  # module path of the switch module, e.g. "model.layers.3.mlp.switch_mlp"
    num_experts: int
    params: tuple[str, ...]  # parameter names relative to the switch module


@dataclass(frozen=True)
class ExpertFile:
    layer: int
    expert: int
    file: str  # relative to a store folder
    bytes: int
    sha256: str  # the authority: checked at start, on arrival, before a migration deletes
    # CRC-32 (8 hex digits): the fast check of every read while serving, much cheaper than
    # SHA-256 (docs/security.md gives the figure). Empty in manifests written before it
    # existed, whose reads are checked with the SHA-256.
    crc32: str = ""


@dataclass(frozen=True)
class Manifest:
    fingerprint: str
    source_id: str
    model_type: str
    config: dict
    layers: tuple[MoeLayer, ...]
    experts: tuple[ExpertFile, ...]
    dense_files: tuple[ExpertFile, ...]  # layer = expert = -1; file relative to dense/

    def layer(self, layer: int) -> MoeLayer:
        for moe_layer in self.layers:
            if moe_layer.layer == layer:
                return moe_layer
        raise NotFound(f"layer {layer} has no routed experts in this model")

    def expert(self, layer: int, expert: int) -> ExpertFile:
        return self._by_key()[(layer, expert)]

    def _by_key(self) -> dict[ExpertKey, ExpertFile]:
        return {(e.layer, e.expert): e for e in self.experts}

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization")

    def to_json(self) -> str:
        body = asdict(self)
        body = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **body}
        return json.dumps(body, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, origin: str) -> Manifest:
        try:
            body = json.loads(text)
            if body.get("format") != MANIFEST_FORMAT:
                raise InvalidInput(f"{origin} is not a Shoal manifest")
            if body.get("version") != MANIFEST_VERSION:
                raise InvalidInput(
                    f"{origin} has manifest version {body.get('version')}; this Shoal reads "
                    f"version {MANIFEST_VERSION}"
                )
            return cls(
                fingerprint=body["fingerprint"],
                source_id=body["source_id"],
                model_type=body["model_type"],
                config=body["config"],
                layers=tuple(
                    MoeLayer(**{**layer, "params": tuple(layer["params"])})
                    for layer in body["layers"]
                ),
                experts=tuple(_expert_file(e) for e in body["experts"]),
                dense_files=tuple(_expert_file(e) for e in body["dense_files"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, InvalidInput):
                raise
            raise CorruptData(f"{origin} is not a readable Shoal manifest ({e})") from None


def _expert_file(entry: dict) -> ExpertFile:
    """An entry of the manifest; fields added by later versions are ignored, so a manifest
    stays readable both ways as fields are added."""
    known = {f.name for f in fields(ExpertFile)}
    return ExpertFile(**{k: v for k, v in entry.items() if k in known})


def not_written_by_shard(folder: Path) -> str | None:
    """Why `folder` is not one `shoal shard` wrote (it does not exist, is a file, or has no
    manifest), or None: one wording for every command that takes such a folder."""
    folder = Path(folder)
    if not folder.exists():
        return f"{folder} does not exist"
    if not folder.is_dir():
        return f"{folder} is a file, not a folder"
    if not (folder / MANIFEST_NAME).is_file():
        return f"{folder} holds no {MANIFEST_NAME}: is it a folder written by `shoal shard`?"
    return None


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST_NAME
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        raise NotFound(not_written_by_shard(folder) or f"{path} is gone") from None
    return Manifest.from_json(text, origin=str(path))


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary name, flush to disk, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def checksums_file(path: Path, chunk: int = 8 << 20) -> tuple[str, str]:
    """The file's SHA-256 and CRC-32 (hex), from one read."""
    digest, crc = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
            crc = zlib.crc32(block, crc)
    return digest.hexdigest(), f"{crc:08x}"


def expert_file_name(layer: int, expert: int) -> str:
    return f"L{layer:03d}/E{expert:04d}.safetensors"
