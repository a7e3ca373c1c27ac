"""Split a source checkpoint into dense weights and one file per routed expert over one or N
store folders (OUT/dense/, OUT/experts/ or OUT/worker-K/L{layer}/E{expert}.safetensors), and
describe the result in OUT/manifest.json (engine/manifest.py)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map
from mlx_lm.utils import make_shards, quantize_model, save_config
from tqdm import tqdm

from engine.errors import InvalidInput, ShoalError
from engine.manifest import (
    MANIFEST_NAME,
    ExpertFile,
    ExpertKey,
    Manifest,
    MoeLayer,
    checksums_file,
    expert_file_name,
    sha256_file,
    write_atomic,
)
from engine.moe_layers import (
    expert_keys,
    find_moe_layers,
    get_module,
    layer_bytes,
    load_source,
    resolve_model_dir,
    weight_files,
)
from engine.mtp import attach_from_files as attach_mtp
from engine.placement import split_by_bytes
from engine.store_lock import claim_for_writing, release

# Which stores (indices into the N store folders) hold each expert, given every expert's bytes.
Place = Callable[[Mapping[ExpertKey, int]], Mapping[ExpertKey, Sequence[int]]]

SHARD_MARKER = ".shoal-shard.json"
_NEARLY_FULL = 256 << 20  # free bytes below which a failed write is put down to a full drive
# Files of a source checkpoint that are weights (rewritten) rather than tokenizer/metadata (copied).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".h5", ".msgpack")


def source_id(model_dir: Path, options: dict) -> str:
    """Identify a source checkpoint cheaply (config, weight file names and sizes, options)."""
    digest = hashlib.sha256()
    digest.update((model_dir / "config.json").read_bytes())
    for path in weight_files(model_dir):
        digest.update(f"{path.name}:{path.stat().st_size};".encode())
    digest.update(json.dumps(options, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def _check_out_dir(
    out_dir: Path, sid: str, model_type: str, stores: list[str], *, force: bool = False
) -> None:
    """Refuse a folder that holds anything but an interrupted split of this model into these
    same store folders; with `force`, replace an earlier split (never a folder `shoal shard`
    did not write, never a store a running worker serves).

    A finished split is refused too: the cluster changes its stores afterwards (`shoal
    rebalance` and `deploy` copy experts in and drop others), and writing the split again
    would leave those copies beside the new files, to be served by nobody's plan.

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
        present = sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name != "dense")
        release(claim_for_writing(out_dir / name for name in present))
        if force:
            _clear_split(out_dir, present)
        elif (out_dir / MANIFEST_NAME).exists():
            raise ShoalError(
                f"{out_dir} already holds a finished split, with store folders "
                f"{', '.join(f'{name}/' for name in present) or 'none'}; writing into it "
                "again would leave the experts the cluster copied there since beside the new "
                "files. Choose an empty folder, or give --force to replace that split"
            )
        else:
            _check_interrupted(out_dir, marker, sid, stores, present)
    body = {"source_id": sid, "model_type": model_type, "stores": stores}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, json.dumps(body).encode())


def _check_interrupted(
    out_dir: Path, marker: Path, sid: str, stores: list[str], present: list[str]
) -> None:
    earlier = json.loads(marker.read_text())
    if earlier.get("source_id") != sid:
        raise ShoalError(
            f"{out_dir} already holds a different model ({earlier.get('model_type')}, "
            "or the same one with other --quantize options); choose another folder or "
            "remove it first"
        )
    # Markers of older versions do not name the stores: then the folders present tell.
    earlier_stores = earlier.get("stores", present)
    if sorted(earlier_stores) != sorted(stores) or not set(present) <= set(stores):
        raise ShoalError(
            f"{out_dir} holds a split into {_describe_stores(earlier_stores)}, not "
            f"{_describe_stores(stores)}: its expert files would be left in the wrong "
            "store folders. Choose another folder, or remove this one first"
        )


def _clear_split(out_dir: Path, stores: list[str]) -> None:
    """What `shoal shard` and the cluster wrote into an earlier split: its stores, dense part,
    manifests, heat and any unfinished rebalance (they describe the old split)."""
    for name in [*stores, "dense"]:
        shutil.rmtree(out_dir / name, ignore_errors=True)
    # The heat record and the stored rebalance target (coordinator/ops/: heat_record.py,
    # rebalancer.py).
    for name in (MANIFEST_NAME, "heat.msgpack", "migration.json", SHARD_MARKER):
        (out_dir / name).unlink(missing_ok=True)


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


def _save_safetensors(path: Path, arrays: dict[str, mx.array], metadata: dict) -> None:
    """Write to a temporary name beside `path`, then rename; a failed write leaves nothing."""
    tmp = path.with_name(f".{path.name}.partial.safetensors")
    try:
        mx.save_safetensors(str(tmp), arrays, metadata=metadata)
    except RuntimeError as e:  # MLX's: "[save_safetensors] Unable to write N bytes"
        tmp.unlink(missing_ok=True)
        raise OSError(errno.EIO, str(e), str(path)) from None
    os.replace(tmp, path)


@contextlib.contextmanager
def _writing(out_dir: Path) -> Iterator[None]:
    """A write that fails (a full disk above all) ends the split with an error a user can act
    on; what was written stays, and the same command finishes it later."""
    try:
        yield
    except OSError as e:
        try:
            free = shutil.disk_usage(out_dir).free
        except OSError:
            free = None
        where = Path(e.filename) if e.filename else out_dir
        if not where.is_relative_to(out_dir):
            raise ShoalError(f"cannot read {where}: {e.strerror or e}") from None
        # MLX reports a short write without its errno; a drive that is (nearly) full is why.
        full = e.errno in (errno.ENOSPC, errno.EDQUOT) or (
            "Unable to write" in str(e) and free is not None and free < _NEARLY_FULL)
        what = "the drive is full" if full else (e.strerror or str(e))
        room = "" if free is None else f"; {free / 2**20:.1f} MiB free there"
        raise ShoalError(
            f"cannot write {where}: {what}{room}. The source is unchanged and the split is "
            "unfinished (no manifest, so no worker serves it): make room, or choose another "
            "OUT_DIR, and run the same command again"
        ) from None


def _save_dense(weights: dict[str, mx.array], dense_dir: Path) -> list[ExpertFile]:
    shards = make_shards(weights)
    name = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = name.format(i + 1, len(shards))
        _save_safetensors(dense_dir / file, shard, {"format": "mlx"})
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
    meta = {"format": "shoal-expert", "layer": str(layer), "expert": str(expert)}
    _save_safetensors(path, tensors, meta)
    return path.stat().st_size


def _copy_file(source: Path, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial.safetensors")
    shutil.copyfile(source, tmp)
    os.replace(tmp, path)


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
    force: bool = False,
    place: Place | None = None,
) -> Manifest:
    """Split a checkpoint into OUT/dense and per-expert files in one or N store folders.

    The source may be a Hugging Face cache entry; OUT may be on another drive than the
    source (every file is written to a temporary name beside its final one, then renamed).
    `force` replaces an earlier finished split in OUT (see _check_out_dir). `place` says
    which of the N stores hold each expert, given every expert's bytes (default: one store
    each, balanced by bytes); an expert placed in several is written to each."""
    model_dir, out_dir = resolve_model_dir(model_dir), Path(out_dir)
    options = {"quantize_bits": quantize_bits, "group_size": group_size}
    if quantize_bits is not None and quantize_bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidInput(f"--quantize takes 2, 3, 4, 5, 6 or 8 bits, not {quantize_bits}")
    if workers is not None and workers < 1:
        raise InvalidInput(f"--workers must be at least 1, got {workers}")
    model, config = load_source(model_dir)
    attach_mtp(model, config, weight_files(model_dir))  # mlx-lm drops it; its experts are kept
    if quantize_bits is not None:
        if config.get("quantization"):
            raise InvalidInput(f"{model_dir} is already quantized; drop --quantize")
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, quantize_bits)
    layers = find_moe_layers(model, config)
    sid = source_id(model_dir, options)
    names = store_names(workers)
    with _writing(out_dir):
        _check_out_dir(out_dir, sid, config.get("model_type", "?"), names, force=force)
        held = claim_for_writing(out_dir / name for name in names)
    try:
        with _writing(out_dir):
            return _write_split(model, config, layers, model_dir, out_dir, sid, names,
                                progress, place)
    finally:
        release(held)


def _write_split(
    model: nn.Module, config: dict, layers: list[MoeLayer], model_dir: Path, out_dir: Path,
    sid: str, names: list[str], progress: bool, place: Place | None = None,
) -> Manifest:
    """Write the dense part, then every expert into its store, then the manifests (last, so
    that a split cut short is never served)."""
    expert_bytes = {}
    for layer in layers:
        per_expert = layer_bytes(model, layer)
        expert_bytes.update(
            {(layer.layer, e): per_expert // layer.num_experts for e in range(layer.num_experts)}
        )
    if place is None:
        groups = split_by_bytes(expert_bytes, len(names))
        stores_of = {key: (names[i],) for i, group in enumerate(groups) for key in group}
    else:
        chosen = place(expert_bytes)
        if set(chosen) != set(expert_bytes) or not all(chosen.values()):
            raise InvalidInput("the placement must give every expert at least one store")
        stores_of = {key: tuple(names[i] for i in chosen[key]) for key in expert_bytes}

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
              disable=None if progress else True) as bar:  # None: no bar off a terminal
        for layer in layers:
            for expert, tensors in _expert_tensors(model, layer):
                name = expert_file_name(layer.layer, expert)
                first, *others = stores_of[(layer.layer, expert)]
                path = out_dir / first / name
                size = _write_expert(path, tensors, layer.layer, expert)
                sha256, crc32 = checksums_file(path)
                for store in others:  # a replica: the same bytes, renamed into place
                    _copy_file(path, out_dir / store / name)
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

