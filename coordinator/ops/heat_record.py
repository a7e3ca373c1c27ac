"""Heat on the coordinator: fetch every worker's reading, its exact token counts (GetHeat),
fold them into the heat record kept next to the model (OUT_DIR/heat.msgpack, so it outlives
runs and worker restarts), and show it: `shoal heat`'s summary, JSON and heat map.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgpack

from coordinator.dataplane.link import WorkerLink
from engine.errors import CorruptData, InvalidInput, ShoalError
from engine.heat import HeatRecord, WorkerCounts, fold_reading
from engine.manifest import ExpertKey, Manifest, write_atomic
from engine.placement import load_imbalance
from proto import shoal_pb2

RECORD_FILE = "heat.msgpack"
HEAT_TIMEOUT = 3.0  # seconds a worker has to answer GetHeat: a small call, read at exit
FORMAT = "shoal-heat"
VERSION = 1


@dataclass(frozen=True)
class Reading:
    """One worker's counts since it started."""

    name: str  # unique among the workers read together (node id, or node id@address)
    boot_id: str
    counts: dict[ExpertKey, int]


def record_path(model_dir: Path) -> Path:
    return Path(model_dir) / RECORD_FILE


def name_workers(ids: Sequence[tuple[str, str]]) -> list[str]:
    """A unique name per (node id, address): the node id, or node id@address where several
    live workers share one."""
    node_ids = [node_id for node_id, _ in ids]
    return [node_id if node_ids.count(node_id) == 1 else f"{node_id}@{address}"
            for node_id, address in ids]


def fetch_readings(links: Sequence[WorkerLink], timeout: float = HEAT_TIMEOUT) -> list[Reading]:
    """Every worker's counts (GetHeat), asked all at once; a worker that does not answer
    within `timeout` seconds is left out."""

    def ask(link: WorkerLink) -> shoal_pb2.HeatReport | ShoalError:
        try:
            return link.call("GetHeat", shoal_pb2.HeatRequest(), timeout=timeout)
        except ShoalError as e:
            return e

    # the coordinator's own experts are asked in this thread, whose graph their picks are
    # (coordinator/dataplane/local_experts.py: LocalExperts.settle)
    with ThreadPoolExecutor(max(len(links), 1)) as pool:
        answers = [ask(link) if link.in_process else pool.submit(ask, link) for link in links]
        answers = [a if not isinstance(a, Future) else a.result() for a in answers]
    replies = []
    for link, answer in zip(links, answers, strict=True):
        if isinstance(answer, ShoalError):
            print(f"shoal: warning: no heat from {link.address}: {answer}", file=sys.stderr)
        else:
            replies.append((link, answer))
    names = name_workers([(reply.node_id, link.address) for link, reply in replies])
    return [
        Reading(name, reply.boot_id, {(h.layer, h.expert): h.tokens for h in reply.experts})
        for name, (_, reply) in zip(names, replies, strict=True)
    ]


# ---------------------------------------------------------------------------------------
# The record on disk


def _pairs(counts: Mapping[ExpertKey, int]) -> list[list[int]]:
    return [[layer, expert, count] for (layer, expert), count in sorted(counts.items())]


def _counts(pairs: Iterable[Sequence[int]]) -> dict[ExpertKey, int]:
    return {(int(layer), int(expert)): int(count) for layer, expert, count in pairs}


def encode_record(record: HeatRecord) -> bytes:
    return msgpack.packb({
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": record.fingerprint,
        "workers": {name: {"boot_id": w.boot_id, "seen": _pairs(w.seen), "total": _pairs(w.total)}
                    for name, w in sorted(record.workers.items())},
    })


def decode_record(data: bytes, *, origin: str) -> HeatRecord:
    try:
        body = msgpack.unpackb(data)
        if body.get("format") != FORMAT or body.get("version") != VERSION:
            raise CorruptData(f"{origin} is not a heat record this Shoal reads")
        workers = {
            name: WorkerCounts(w["boot_id"], _counts(w["seen"]), _counts(w["total"]))
            for name, w in body["workers"].items()
        }
        return HeatRecord(body["fingerprint"], workers)
    except (msgpack.UnpackException, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptData(f"{origin} is not a readable heat record ({e})") from None


def load_record(path: Path, fingerprint: str) -> HeatRecord:
    """The recorded heat of this model; empty when there is none yet or it is another model's."""
    try:
        record = decode_record(Path(path).read_bytes(), origin=str(path))
    except FileNotFoundError:
        return HeatRecord(fingerprint)
    if record.fingerprint != fingerprint:
        print(f"shoal: warning: {path} holds the heat of another model; starting afresh",
              file=sys.stderr)
        return HeatRecord(fingerprint)
    return record


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Several coordinators may fold readings at once: one at a time."""
    with open(path.with_name(f".{path.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_heat(model_dir: Path, manifest: Manifest, readings: Sequence[Reading]) -> HeatRecord:
    """Fold the readings into OUT_DIR/heat.msgpack and return the updated record."""
    path = record_path(model_dir)
    try:
        with _locked(path):
            record = load_record(path, manifest.fingerprint)
            for r in readings:
                record = fold_reading(record, r.name, r.boot_id, r.counts)
            write_atomic(path, encode_record(record))
    except OSError as e:
        raise ShoalError(f"cannot record the heat in {path}: {e.strerror or e}") from None
    return record


def reset_heat(model_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(model_dir))


# ---------------------------------------------------------------------------------------
# Showing it


def summarize_heat(record: HeatRecord, manifest: Manifest, *, layer: int | None = None,
                   top: int = 10) -> dict:
    """Everything `shoal heat` prints, as plain data: the hottest experts, each layer's skew,
    and each worker's load (with the measured imbalance: busiest worker over the mean)."""
    total = record.total()
    layers = {moe.layer: moe.num_experts for moe in manifest.layers}
    if layer is not None and layer not in layers:
        raise InvalidInput(f"layer {layer} has no routed experts; MoE layers are "
                           f"{min(layers)}-{max(layers)}")
    shown = [layer] if layer is not None else sorted(layers)
    per_layer = {}
    for lay in shown:
        counts = [total.get((lay, e), 0) for e in range(layers[lay])]
        tokens = sum(counts)
        mean = tokens / len(counts)
        per_layer[lay] = {
            "tokens": tokens,
            "hottest": max(range(len(counts)), key=lambda e: (counts[e], -e)),
            "max_over_mean": max(counts) / mean if mean else 0.0,
            "top_share": max(counts) / tokens if tokens else 0.0,
            "unused": sum(c == 0 for c in counts),
            "experts": layers[lay],
        }
    layer_tokens = {lay: sum(c for (la, _), c in total.items() if la == lay) for lay in layers}
    hottest = sorted(((c, k) for k, c in total.items() if k[0] in shown),
                     key=lambda item: (-item[0], item[1]))
    workers = record.per_worker()
    worker_tokens = {name: sum(c.values()) for name, c in workers.items()}
    all_tokens = sum(worker_tokens.values())
    return {
        "fingerprint": record.fingerprint,
        "tokens": sum(total.values()),
        "hottest": [{"layer": k[0], "expert": k[1], "tokens": c,
                     "share_of_layer": c / layer_tokens[k[0]] if layer_tokens[k[0]] else 0.0}
                    for c, k in hottest[:top]],
        "layers": per_layer,
        "workers": {name: {"tokens": t, "share": t / all_tokens if all_tokens else 0.0}
                    for name, t in worker_tokens.items()},
        "measured_imbalance": load_imbalance(workers) if workers else None,
    }


def format_heat_summary(s: dict) -> str:
    if not s["tokens"]:
        return ("no heat recorded yet: the workers count tokens as they compute them; generate "
                "something, then run `shoal heat` again")
    lines = [f"heat of model {s['fingerprint'][:12]}: {s['tokens']} (token, expert) pairs"]
    lines.append("hottest experts:")
    lines.append(f"  {'layer/expert':>12} {'tokens':>10} {'of layer':>9}")
    for h in s["hottest"]:
        lines.append(f"  {h['layer']:>6}/{h['expert']:<5} {h['tokens']:>10} "
                     f"{h['share_of_layer']:>8.1%}")
    lines.append("skew per layer:")
    lines.append(f"  {'layer':>5} {'tokens':>10} {'hottest':>8} {'max/mean':>9} {'top share':>10} "
                 f"{'unused':>7}")
    for lay, r in s["layers"].items():
        lines.append(f"  {lay:>5} {r['tokens']:>10} {r['hottest']:>8} {r['max_over_mean']:>9.2f} "
                     f"{r['top_share']:>10.1%} {r['unused']:>4}/{r['experts']}")
    lines.append("load per worker (tokens it computed):")
    for name, w in s["workers"].items():
        lines.append(f"  {name:<24} {w['tokens']:>10} {w['share']:>7.1%}")
    if s["measured_imbalance"] is not None:
        lines.append(f"measured imbalance (busiest worker / mean, per layer): "
                     f"{s['measured_imbalance']:.2f}")
    return "\n".join(lines)


def colour_limits(largest: float) -> tuple[float, float]:
    """The colour scale of a heat map: from zero tokens to the hottest expert's count.

    Left to itself matplotlib scales from the smallest count to the largest, so a uniform
    model (every count equal) got a bar spanning a sliver around that one value, its cells a
    middle colour that reads as "lukewarm" instead of "all equally hot".
    """
    return 0.0, max(float(largest), 1.0)


def plot_heat(record: HeatRecord, manifest: Manifest, path: Path) -> None:
    """A PNG heat map: one row per MoE layer, one column per expert, colour = tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ShoalError("--plot needs matplotlib: pip install matplotlib") from None
    import numpy as np

    total = record.total()
    layers = [moe.layer for moe in manifest.layers]
    width = max(moe.num_experts for moe in manifest.layers)
    grid = np.zeros((len(layers), width))
    for row, lay in enumerate(layers):
        for e in range(width):
            grid[row, e] = total.get((lay, e), 0)
    fig, ax = plt.subplots(figsize=(max(6.0, width / 8), max(3.0, len(layers) / 4)))
    low, high = colour_limits(grid.max())
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="inferno",
                      vmin=low, vmax=high)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(layers)), [str(lay) for lay in layers])
    ax.set_title(f"tokens per expert ({manifest.model_type}, {int(grid.sum())} in all)")
    fig.colorbar(image, ax=ax, label="tokens")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise ShoalError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
