"""Checkpoints: read an mlx-lm MoE checkpoint, split it into dense weights and one file per
expert, and describe the result in a manifest that both sides trust.

Layout written by `shard`:
    OUT/manifest.json             the model: config, MoE layers, every expert file + checksum
    OUT/dense/                    config, tokenizer files, every weight except routed experts
    OUT/experts/ or OUT/worker-K/ store folders: manifest.json + L{layer}/E{expert}.safetensors
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import struct
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.switch_layers import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    SwitchMLP,
)
from mlx_lm.utils import load_model, make_shards, quantize_model, save_config
from tqdm import tqdm

from engine.errors import CorruptData, InvalidInput, NotFound, ShoalError
from engine.placement import split_by_bytes

MANIFEST_NAME = "manifest.json"
SHARD_MARKER = ".shoal-shard.json"
MANIFEST_FORMAT = "shoal-manifest"
MANIFEST_VERSION = 1
# The seam: mlx-lm's routed-expert modules, called as `module(x, inds)` by every MoE block,
# whatever attribute name the block keeps them under (switch_mlp, experts, switch_glu, ...).
SWITCH_CLASSES = (SwitchGLU, SwitchMLP)
SWITCH_LINEARS = (SwitchLinear, QuantizedSwitchLinear)
# Files of a source checkpoint that are weights (rewritten) rather than tokenizer/metadata (copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


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
    # CRC-32 (8 hex digits): the fast check of every read while serving, about 2.4x cheaper
    # than SHA-256 (docs/security.md). Empty in manifests written before it existed, whose
    # reads are checked with the SHA-256.
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

    def _by_key(self) -> dict[tuple[int, int], ExpertFile]:
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


def read_manifest(folder: Path) -> Manifest:
    path = Path(folder) / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise NotFound(
            f"{folder} holds no {MANIFEST_NAME}: is it a folder written by `shoal shard`?"
        ) from None
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


# ---------------------------------------------------------------------------------------
# Reading a source checkpoint


def check_safetensors(path: Path) -> None:
    """Refuse a safetensors file whose header is unreadable or whose data is cut short."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise CorruptData(f"{path} is truncated or not a safetensors file")
            header = json.loads(f.read(header_len))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise CorruptData(f"{path} is not a readable safetensors file") from None
    except OSError as e:
        raise ShoalError(f"cannot read {path}: {e.strerror}") from None
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise CorruptData(f"{path} is truncated: its header needs {needed} bytes, file has {size}")


def _weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("model*.safetensors"))


def source_id(model_dir: Path, options: dict) -> str:
    """Identify a source checkpoint cheaply (config, weight file names and sizes, options)."""
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in _weight_files(model_dir):
        digest.update(f"{path.name}:{path.stat().st_size};".encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def get_module(model: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted path such as "model.layers.3.mlp.switch_mlp"."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _expert_counts(config: dict) -> list[int]:
    """Expert counts a config states, top level or nested (text_config of llama4, gemma4)."""
    nested = [v for v in config.values() if isinstance(v, dict)]
    return [c[k] for c in (config, *nested) for k in _EXPERT_COUNT_KEYS
            if isinstance(c.get(k), int) and not isinstance(c.get(k), bool)]


def find_moe_layers(model: nn.Module, config: dict) -> tuple[MoeLayer, ...]:
    """Every routed-expert switch module in the model (found by its mlx-lm class, wherever
    the block keeps it), or a clear refusal."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, SWITCH_CLASSES):
            continue
        stacked = switch_parameters(module)
        params = tuple(name for name, _ in stacked)
        counts = {name: arr.shape[0] for name, arr in stacked}
        if not params or len(set(counts.values())) != 1:
            raise ShoalError(
                f"{path} does not hold experts stacked on a leading axis; Shoal cannot split it"
            )
        # The layer is the first list index on the path (model.layers.3..., transformer.h.3...):
        # named_modules() does not walk layers in order (phixtral's came out reversed).
        match = re.search(r"(?:^|\.)(\d+)\.", path)
        layer = int(match.group(1)) if match else len(found)
        found.append(MoeLayer(layer, path, next(iter(counts.values())), params))
    model_type = config.get("model_type", "?")
    if not found:
        if any(count > 1 for count in _expert_counts(config)):
            raise ShoalError(
                f"model type {model_type!r} has experts, but its MoE block does not keep them "
                "in mlx-lm's SwitchGLU/SwitchMLP module, so Shoal cannot serve them remotely"
            )
        raise ShoalError(f"model type {model_type!r} is a dense model: it has no routed experts")
    found.sort(key=lambda layer: layer.layer)
    if len({layer.layer for layer in found}) != len(found):
        raise ShoalError(f"model type {model_type!r} has two switch modules in one layer")
    return tuple(found)


def resolve_model_dir(model_dir: Path) -> Path:
    """A model folder, or a Hugging Face cache entry (models--ORG--NAME, as `hf download`
    leaves it) -> the snapshot folder that holds config.json and the weights (symlinks into
    blobs/, read through as ordinary files)."""
    model_dir = Path(model_dir)
    snapshots = model_dir / "snapshots"
    if (model_dir / "config.json").exists() or not snapshots.is_dir():
        return model_dir
    ref = model_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = sorted(p for p in snapshots.iterdir() if (p / "config.json").exists())
    if len(found) != 1:
        names = ", ".join(p.name[:12] for p in found) or "none with a config.json"
        raise NotFound(f"{model_dir} is a Hugging Face cache entry with snapshots {names}: "
                       "give the snapshot folder (snapshots/HASH) to use")
    return found[0]


def load_source(model_dir: Path) -> tuple[nn.Module, dict]:
    """Load any mlx-lm checkpoint lazily (weights are read only when evaluated)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise NotFound(f"{model_dir} has no config.json: is it a model folder?")
    files = _weight_files(model_dir)
    if not files:
        raise NotFound(f"{model_dir} has no model*.safetensors weight files")
    for path in files:
        check_safetensors(path)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return load_model(model_dir, lazy=True)
    except ValueError as e:
        raise ShoalError(f"mlx-lm cannot load {model_dir}: {e}") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"{model_dir}/config.json is not valid JSON ({e})") from None


# ---------------------------------------------------------------------------------------
# Writing a sharded checkpoint


def expert_keys(layers: Iterable[MoeLayer]) -> set[str]:
    """The model's parameter names that are routed experts (split into per-expert files);
    every other parameter is dense."""
    return {f"{layer.path}.{name}" for layer in layers for name in layer.params}


def switch_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """A switch module's routed experts: its switch linears' parameters (weights, and scales
    and biases once quantized). A block may hang other modules on the switch (muse_spark: a
    norm applied after the combination); those stay dense."""
    linears = {name for name, child in module.named_modules() if isinstance(child, SWITCH_LINEARS)}
    return [(name, arr) for name, arr in tree_flatten(module.parameters())
            if name.rsplit(".", 1)[0] in linears]


def layer_bytes(model: nn.Module, layer: MoeLayer) -> int:
    """Bytes of one layer's routed experts, all of them, as the module holds them now."""
    return sum(arr.nbytes for _, arr in switch_parameters(get_module(model, layer.path)))


def _check_out_dir(out_dir: Path, sid: str, model_type: str, stores: list[str]) -> None:
    """Refuse a folder that holds anything but an earlier (maybe interrupted) split of this
    model into these same store folders.

    A marker naming the source and the stores is written before anything else, so an
    interrupted run can be repeated into the same folder, while a different model, or the same
    one split for another number of workers (whose old expert files would stay behind in
    worker-0 and be served), is never mixed in.
    """
    marker = out_dir / SHARD_MARKER
    if out_dir.exists() and any(out_dir.iterdir()):
        if not marker.exists():
            raise ShoalError(
                f"{out_dir} is not empty and was not written by `shoal shard`; "
                "choose an empty folder"
            )
        earlier = json.loads(marker.read_text())
        if earlier.get("source_id") != sid:
            raise ShoalError(
                f"{out_dir} already holds a different model ({earlier.get('model_type')}, "
                "or the same one with other --quantize options); choose another folder or "
                "remove it first"
            )
        present = sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name != "dense")
        # Markers of older versions do not name the stores: then the folders present tell.
        earlier_stores = earlier.get("stores", present)
        if sorted(earlier_stores) != sorted(stores) or not set(present) <= set(stores):
            raise ShoalError(
                f"{out_dir} holds a split into {_describe_stores(earlier_stores)}, not "
                f"{_describe_stores(stores)}: its expert files would be left in the wrong "
                "store folders. Choose another folder, or remove this one first"
            )
    body = {"source_id": sid, "model_type": model_type, "stores": stores}
    write_atomic(marker, json.dumps(body).encode())


def _describe_stores(stores: list[str]) -> str:
    if stores == ["experts"]:
        return "one store folder (experts/)"
    return f"{len(stores)} store folders ({', '.join(sorted(stores))})"


def _copy_side_files(model_dir: Path, dense_dir: Path) -> None:
    """Tokenizer, chat template and other small files travel with the dense part."""
    for path in sorted(model_dir.iterdir()):
        if not path.is_file() or path.name == "config.json" or path.name.startswith("."):
            continue
        if path.suffix in _WEIGHT_SUFFIXES or path.name.endswith(".index.json"):
            continue
        shutil.copy2(path, dense_dir / path.name)


def _save_dense(weights: dict[str, mx.array], dense_dir: Path) -> list[ExpertFile]:
    shards = make_shards(weights)
    name = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = name.format(i + 1, len(shards))
        tmp = dense_dir / f".{file}.partial.safetensors"
        mx.save_safetensors(str(tmp), shard, metadata={"format": "mlx"})
        os.replace(tmp, dense_dir / file)
        weight_map.update(dict.fromkeys(shard, file))
        path = dense_dir / file
        files.append(ExpertFile(-1, -1, file, path.stat().st_size, sha256_file(path)))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    write_atomic(dense_dir / "model.safetensors.index.json", json.dumps(index, indent=1).encode())
    return files


def _expert_tensors(
    model: nn.Module, layer: MoeLayer
) -> Iterator[tuple[int, dict[str, mx.array]]]:
    """Yield (expert, its tensors) for one layer, then free the layer's stacked arrays."""
    module = get_module(model, layer.path)
    stacked = dict(tree_flatten(module.parameters()))
    mx.eval(stacked)
    for expert in range(layer.num_experts):
        yield expert, {name: stacked[name][expert] for name in layer.params}
    module.update(tree_map(lambda _: mx.array([]), module.parameters()))


def _write_expert(path: Path, tensors: dict[str, mx.array], layer: int, expert: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.safetensors")
    meta = {"format": "shoal-expert", "layer": str(layer), "expert": str(expert)}
    mx.save_safetensors(str(tmp), tensors, metadata=meta)
    os.replace(tmp, path)
    return path.stat().st_size


def _fingerprint(config: dict, dense: Iterable[ExpertFile], experts: Iterable[ExpertFile]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for f in sorted(dense, key=lambda f: f.file):
        digest.update(f"{f.file}:{f.sha256};".encode())
    for f in sorted(experts, key=lambda f: (f.layer, f.expert)):
        digest.update(f"{f.layer}/{f.expert}:{f.sha256};".encode())
    return digest.hexdigest()


def store_names(workers: int | None) -> list[str]:
    return ["experts"] if workers is None else [f"worker-{k}" for k in range(workers)]


def shard(
    model_dir: Path,
    out_dir: Path,
    *,
    workers: int | None = None,
    quantize_bits: int | None = None,
    group_size: int = 64,
    progress: bool = True,
) -> Manifest:
    """Split a checkpoint into OUT/dense and per-expert files in one or N store folders.

    The source may be a Hugging Face cache entry; OUT may be on another drive than the
    source (every file is written to a temporary name beside its final one, then renamed)."""
    model_dir, out_dir = resolve_model_dir(model_dir), Path(out_dir)
    options = {"quantize_bits": quantize_bits, "group_size": group_size}
    if quantize_bits is not None and quantize_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidInput(f"--quantize takes 2, 3, 4, 5, 6 or 8 bits, not {quantize_bits}")
    if workers is not None and workers < 1:
        raise InvalidInput(f"--workers must be at least 1, got {workers}")
    model, config = load_source(model_dir)
    if quantize_bits is not None:
        if config.get("quantization"):
            raise InvalidInput(f"{model_dir} is already quantized; drop --quantize")
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, quantize_bits)
    layers = find_moe_layers(model, config)
    sid = source_id(model_dir, options)
    names = store_names(workers)
    _check_out_dir(out_dir, sid, config.get("model_type", "?"), names)

    expert_bytes = {}
    for layer in layers:
        per_expert = layer_bytes(model, layer)
        expert_bytes.update(
            {(layer.layer, e): per_expert // layer.num_experts for e in range(layer.num_experts)}
        )
    groups = split_by_bytes(expert_bytes, len(names))
    store_of = {key: names[i] for i, group in enumerate(groups) for key in group}

    dense_dir = out_dir / "dense"
    dense_dir.mkdir(parents=True, exist_ok=True)
    routed = expert_keys(layers)
    dense = {k: v for k, v in tree_flatten(model.parameters()) if k not in routed}
    dense_files = _save_dense(dense, dense_dir)
    del dense
    config_out = dict(config)
    save_config(config_out, dense_dir / "config.json")
    _copy_side_files(model_dir, dense_dir)

    experts = []
    total = sum(expert_bytes.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="sharding experts",
              disable=not progress) as bar:
        for layer in layers:
            for expert, tensors in _expert_tensors(model, layer):
                name = expert_file_name(layer.layer, expert)
                path = out_dir / store_of[(layer.layer, expert)] / name
                size = _write_expert(path, tensors, layer.layer, expert)
                sha256, crc32 = checksums_file(path)
                experts.append(ExpertFile(layer.layer, expert, name, size, sha256, crc32))
                bar.update(expert_bytes[(layer.layer, expert)])

    config = json.loads((dense_dir / "config.json").read_text())
    manifest = Manifest(
        fingerprint=_fingerprint(config, dense_files, experts),
        source_id=sid,
        model_type=config["model_type"],
        config=config,
        layers=layers,
        experts=tuple(experts),
        dense_files=tuple(dense_files),
    )
    text = manifest.to_json().encode()
    for name in names:
        write_atomic(out_dir / name / MANIFEST_NAME, text)
    write_atomic(out_dir / MANIFEST_NAME, text)
    return manifest


# ---------------------------------------------------------------------------------------
# Sizes for planning


@dataclass(frozen=True)
class ModelSizes:
    """What placement planning needs to know about a model, from a manifest or a config."""

    model_type: str
    experts: dict[tuple[int, int], int]  # (layer, expert) -> bytes
    dense_bytes: int
    top_k: int
    estimated: bool  # True when computed from a config rather than read from real files
    precision: str = ""  # how the weights are stored, in words, e.g. "4-bit affine, group 64"
    expert_bits: float = 0.0  # bits per routed-expert parameter, scales included


def _top_k(config: dict) -> int:
    text = config.get("text_config", {})
    return int(config.get("num_experts_per_tok") or text.get("num_experts_per_tok") or 1)


def _describe_quantization(config: dict) -> str:
    q = config.get("quantization")
    if not q:
        return str(config.get("torch_dtype") or config.get("dtype") or "as stored")
    mixed = any(isinstance(v, dict | bool) for v in q.values())
    text = f"{q.get('bits')}-bit {q.get('mode', 'affine')}, group {q.get('group_size')}"
    return text + (" with per-layer overrides" if mixed else "")


def sizes_from_manifest(manifest: Manifest) -> ModelSizes:
    experts = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    dense = sum(f.bytes for f in manifest.dense_files)
    # A manifest holds bytes, not parameter counts: bits per weight stay unknown (0).
    return ModelSizes(manifest.model_type, experts, dense, _top_k(manifest.config), False,
                      _describe_quantization(manifest.config))


# Floating dtypes a Hugging Face config names in torch_dtype (older) or dtype (newer).
_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


@dataclass(frozen=True)
class _Storage:
    """How the weights a worker will hold are stored, as decided from a config."""

    dtype: mx.Dtype  # of everything not quantized
    quantization: dict | None  # mlx-lm's {"group_size", "bits", "mode", per-path overrides}
    skip: tuple[str, ...]  # module names or "re:" patterns a Hugging Face config leaves as is
    words: str


def _config_dtype(config: dict) -> tuple[mx.Dtype, str]:
    text = config.get("text_config", {})
    name = (config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
            or text.get("dtype"))
    if name is None:
        return mx.bfloat16, "bfloat16 (assumed: the config names no dtype)"
    if name not in _DTYPES:
        raise InvalidInput(f"the config's dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name], name


def _hf_quantization(qc: dict, dtype_words: str) -> tuple[dict | None, tuple[str, ...], str]:
    """Map a Hugging Face quantization_config to what mlx-lm's loader turns it into."""
    method = qc.get("quant_method")
    skip = tuple(qc.get("ignore") or qc.get("modules_to_not_convert") or ())
    block = list(qc.get("weight_block_size") or ())
    if method == "fp8" and qc.get("scale_fmt") == "ue8m0" and block == [32, 32]:
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}, skip, "FP8 kept as mxfp8"
    if method == "fp8":
        # mlx-lm dequantizes block-scaled FP8 in the model's sanitize(), so what `shoal shard`
        # writes (and workers hold) is the config's dtype unless --quantize is given.
        blocks = "x".join(map(str, block)) or "per-tensor"
        return None, skip, (f"FP8 (blocks {blocks}) in the source, which mlx-lm loads as "
                            f"{dtype_words}; plan --bits 8 (or 4) for `shoal shard --quantize`")
    if method in ("mxfp4", "mxfp8"):
        q = {"group_size": 32, "bits": 4 if method == "mxfp4" else 8, "mode": method}
        return q, skip, method
    if method == "compressed-tensors":
        fmt = qc.get("format")
        modes = {"pack-quantized": "affine", "nvfp4-pack-quantized": "nvfp4",
                 "mxfp4-pack-quantized": "mxfp4"}
        if fmt not in modes:
            raise InvalidInput(
                f"mlx-lm cannot load compressed-tensors format {fmt!r}; dequantize the "
                "checkpoint to bf16 first (then plan with --bits)"
            )
        weights = next(iter((qc.get("config_groups") or {"": {}}).values())).get("weights", {})
        defaults = {"affine": (32, 4), "nvfp4": (16, 4), "mxfp4": (32, 4)}[modes[fmt]]
        q = {"group_size": weights.get("group_size") or defaults[0],
             "bits": weights.get("num_bits") or defaults[1], "mode": modes[fmt]}
        return q, skip, f"compressed-tensors {fmt}"
    if method in ("awq", "gptq"):
        q = {"group_size": qc.get("group_size", 128), "bits": qc.get("bits", 4), "mode": "affine"}
        return q, skip, method
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}, \
            skip, "ModelOpt NVFP4"
    raise InvalidInput(f"Shoal cannot size a checkpoint quantized with {method!r}")


def _storage(config: dict, bits: int | None, group_size: int) -> _Storage:
    dtype, dtype_words = _config_dtype(config)
    if bits is not None:
        q = {"group_size": group_size, "bits": bits, "mode": "affine"}
        return _Storage(dtype, q, (), f"{bits}-bit affine, group {group_size} (as "
                        f"`shoal shard --quantize {bits}` would write it)")
    if config.get("quantization"):  # an mlx-lm conversion: mlx-community and mlx_lm.convert
        return _Storage(dtype, config["quantization"], (), _describe_quantization(config))
    qc = config.get("quantization_config") or config.get("text_config", {}).get(
        "quantization_config")
    if qc:
        q, skip, words = _hf_quantization(qc, dtype_words)
        return _Storage(dtype, q, skip, words)
    return _Storage(dtype, None, (), dtype_words)


# mlx-lm modules that its sanitize() derives from a Hugging Face module of another name
# (MLA's kv_b_proj is split into the two absorbed projections).
_HF_SOURCE_NAMES = {"embed_q": "kv_b_proj", "unembed_out": "kv_b_proj"}


def _skipped(path: str, skip: tuple[str, ...], switches: tuple[str, ...]) -> bool:
    """Whether a Hugging Face ignore list names this mlx-lm module. HF names every expert
    (mlp.experts.3.up_proj) where mlx-lm stacks them in a switch module (mlp.switch_mlp.up_proj,
    `switches` being those modules' paths)."""
    parent, _, leaf = path.rpartition(".")
    hf = f"{parent}.{_HF_SOURCE_NAMES.get(leaf, leaf)}".lstrip(".")
    names = [path, hf]
    for switch in switches:
        if path.startswith(switch + "."):
            names.append(f"{switch.rpartition('.')[0]}.experts.0.{path[len(switch) + 1:]}")
    return any(
        any(re.match(entry[3:], n) for n in names) if entry.startswith("re:") else entry in names
        for entry in skip
    )


def estimate_sizes(config: dict, *, bits: int | None = None, group_size: int = 64) -> ModelSizes:
    """Byte sizes from a config alone (a model not downloaded yet), as workers will hold them.

    mlx-lm builds the module tree with lazy weights, so nothing is allocated: the tree is cast
    to the config's dtype and quantized the way mlx-lm's loader would (an MLX `quantization`
    entry with its per-layer overrides, or a Hugging Face `quantization_config`), or as
    `shoal shard --quantize BITS` would when `bits` asks "what if".
    """
    from engine.experts import build_skeleton

    storage = _storage(config, bits, group_size)
    model = build_skeleton(config)
    params = {name: a.size for name, a in tree_flatten(model.parameters())}
    layers = find_moe_layers(model, config)
    switches = tuple(layer.path for layer in layers)
    model.set_dtype(storage.dtype)
    q = storage.quantization
    if q:
        quant_predicate = getattr(model, "quant_predicate", None)

        def predicate(path: str, module: nn.Module) -> bool | dict:
            if path in q:  # mlx-lm's per-layer entries (mixed quantization)
                return q[path]
            if not hasattr(module, "to_quantized") or _skipped(path, storage.skip, switches):
                return False
            if module.weight.shape[-1] % q["group_size"]:
                return False
            return quant_predicate(path, module) if quant_predicate else True

        nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                    mode=q.get("mode", "affine"), class_predicate=predicate)
    experts = {}
    expert_total = expert_params = 0
    for layer in layers:
        module_bytes = layer_bytes(model, layer)
        expert_total += module_bytes
        expert_params += sum(n for name, n in params.items()
                             if name.startswith(layer.path + ".") and name.endswith("weight"))
        per_expert = module_bytes // layer.num_experts
        experts.update({(layer.layer, e): per_expert for e in range(layer.num_experts)})
    total = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    return ModelSizes(config.get("model_type", "?"), experts, total - expert_total,
                      _top_k(config), True, storage.words,
                      8 * expert_total / expert_params if expert_params else 0.0)


def read_sizes(path: Path, *, bits: int | None = None, group_size: int = 64) -> ModelSizes:
    """Sizes of a sharded model folder (its manifest), or estimated from a config.json
    (`bits`: as if quantized to that many bits, which only a config can answer)."""
    path = Path(path)
    if (path / MANIFEST_NAME).exists():
        if bits is not None:
            raise InvalidInput(
                f"{path} is already sharded, so its sizes are real; --bits applies to a "
                "config.json (plan the source model's config instead)"
            )
        return sizes_from_manifest(read_manifest(path))
    config_path = resolve_model_dir(path) / "config.json" if path.is_dir() else path
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise NotFound(f"{path} is neither a sharded model folder nor a config.json") from None
    except json.JSONDecodeError as e:
        raise CorruptData(f"{config_path} is not valid JSON ({e})") from None
    return estimate_sizes(config, bits=bits, group_size=group_size)
