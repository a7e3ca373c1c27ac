"""docs/benchmarks.md's figures, rendered from the newest result record of each (machine,
what) in the results folder: the tables' rows and the Mac projection's inputs live here."""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from benchmarks.records import REPO, load, results_folder, value
from engine.errors import ShoalError

DOC = REPO / "docs" / "benchmarks.md"
BLOCK = re.compile(r"(<!-- rendered: (\S+) -->\n).*?(<!-- /rendered -->)", re.S)
Slot = tuple[str, str]  # (machine label, what)
Records = dict[Slot, tuple[Path, dict]]


class MissingFigure(ShoalError):
    """A figure the docs show has no record, or its record lacks the figure."""


@dataclass(frozen=True)
class Cell:
    slot: Slot
    key: str  # dotted path in the record
    fmt: str = ".1f"


@dataclass(frozen=True)
class Row:
    label: str
    shoal: Cell | tuple[Cell, ...]
    baseline: Cell | tuple[Cell, ...] | None = None
    baseline_label: str = ""


def newest(folder: Path) -> Records:
    """Each (machine, what)'s newest record; files that are not records are passed over."""
    found: Records = {}
    for path in sorted(folder.glob("*.json")):
        try:
            record = load(path)
        except (ValueError, KeyError):
            continue
        slot = (record["machine"]["label"], record["what"])
        if slot not in found or record["recorded"] > found[slot][1]["recorded"]:
            found[slot] = (path, record)
    return found


def figure(records: Records, cell: Cell) -> list[float]:
    if cell.slot not in records:
        raise MissingFigure(f"no record of {cell.slot[1]!r} on {cell.slot[0]!r} in the results "
                            f"folder (it backs {cell.key})")
    path, record = records[cell.slot]
    node = record
    for part in cell.key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, list):
        return [float(v) for v in node]
    try:
        return [value(record, cell.key)]
    except KeyError:
        raise MissingFigure(f"{path.name} has no figure {cell.key}") from None


def shown(values: list[float], fmt: str) -> str:
    return " and ".join(format(v, fmt) for v in values)


def cells(records: Records, spec: Cell | tuple[Cell, ...]) -> tuple[str, list[float]]:
    """A cell's text (several figures joined by " / ") and the first figure's values."""
    group = spec if isinstance(spec, tuple) else (spec,)
    values = [figure(records, c) for c in group]
    return " / ".join(shown(v, c.fmt) for v, c in zip(values, group, strict=True)), values[0]


def source(records: Records, slots: list[Slot]) -> str:
    parts = []
    for slot in dict.fromkeys(slots):
        path, record = records[slot]
        parts.append(f"[{path.name}](measurements/{path.name}): `{record['command']}` "
                     f"at {record['commit']}")
    return "; ".join(parts)


def slots_of(spec: Cell | tuple[Cell, ...] | None) -> list[Slot]:
    if spec is None:
        return []
    return [c.slot for c in (spec if isinstance(spec, tuple) else (spec,))]


def table(records: Records, rows: tuple[Row, ...]) -> list[str]:
    lines = ["| figure | Shoal | baseline | Shoal / baseline | record |", "|---|---|---|---|---|"]
    for row in rows:
        ours, our_values = cells(records, row.shoal)
        theirs, ratio = "", ""
        if row.baseline is not None:
            text, their_values = cells(records, row.baseline)
            theirs = f"{row.baseline_label} {text}".strip()
            ratio = f"{statistics.mean(our_values) / statistics.mean(their_values):.2f}x"
        where = source(records, slots_of(row.shoal) + slots_of(row.baseline))
        lines.append(f"| {row.label} | {ours} | {theirs} | {ratio} | {where} |")
    return lines


H200, H100, CPU = "h200", "h100-80gb-hbm3", "cpu"
SHOAL, MLX = "figures.shoal", "baselines.mlx_lm_single"


def bench_cell(machine: str, key: str, fmt: str = ".1f", what: str = "bench") -> Cell:
    return Cell((machine, what), key, fmt)


def bench_rows(machine: str, what: str = "bench") -> tuple[Row, ...]:
    """What every `shoal bench` record holds: two workers against mlx-lm's three ways."""
    cell = partial(bench_cell, machine, what=what)

    return (
        Row("decode tok/s, two workers", cell(f"{SHOAL}.decode_tps"),
            cell(f"{MLX}.decode_tps"), "mlx-lm, one process"),
        Row("decode tok/s, two workers", cell(f"{SHOAL}.decode_tps"),
            cell("baselines.mlx_lm_tensor_parallel.decode_tps"), "mlx-lm tensor parallel"),
        Row("decode tok/s, two workers", cell(f"{SHOAL}.decode_tps"),
            cell("baselines.mlx_lm_pipeline_parallel.decode_tps"), "mlx-lm pipeline parallel"),
        Row("prefill tok/s, 512-token prompt, two workers", cell(f"{SHOAL}.prefill_tps.512"),
            cell(f"{MLX}.prefill_tps.512"), "mlx-lm, one process"),
        Row("one MoE layer's overhead beyond the slowest worker (ms)",
            cell("layer_overhead_ms", ".2f"), cell(f"{SHOAL}.echo.round_trip_ms", ".2f"),
            "bare gRPC echo over TLS"),
    )


def local_rows(machine: str, what: str = "bench") -> tuple[Row, ...]:
    """The one-machine configurations and the lane echo, in bench records since they came."""
    cell = partial(bench_cell, machine, what=what)

    return (
        Row("decode tok/s, one machine, every expert local (`--local-store`)",
            cell("figures.shoal_one_mac_all_local.decode_tps"), cell(f"{MLX}.decode_tps"),
            "mlx-lm, one process"),
        Row("prefill tok/s, 512-token prompt, every expert local",
            cell("figures.shoal_one_mac_all_local.prefill_tps.512"),
            cell(f"{MLX}.prefill_tps.512"), "mlx-lm, one process"),
        Row("decode tok/s, one local store + one worker",
            cell("figures.shoal_one_local_one_remote.decode_tps"),
            cell(f"{SHOAL}.decode_tps"), "two workers"),
        Row("one MoE layer's overhead beyond the slowest worker (ms)",
            cell("layer_overhead_ms", ".2f"), cell(f"{SHOAL}.echo.lane_round_trip_ms", ".2f"),
            "bare expert-lane echo"),
    )


ONE_MACHINE = (H200, "one-machine")
H100_BENCH = (H100, "bench-prefill")  # `shoal bench --lengths 16,512,4096`: a 4,096-token pass

H100_ROWS = bench_rows(H100, "bench-prefill") + local_rows(H100, "bench-prefill") + (
    Row("prefill tok/s, 4,096-token prompt, two workers",
        Cell(H100_BENCH, f"{SHOAL}.prefill_tps.4096", ".1f"),
        Cell(H100_BENCH, f"{MLX}.prefill_tps.4096", ".1f"), "mlx-lm, one process"),
    Row("prefill tok/s, 4,096-token prompt, every expert local",
        Cell(H100_BENCH, "figures.shoal_one_mac_all_local.prefill_tps.4096", ".1f"),
        Cell(H100_BENCH, f"{MLX}.prefill_tps.4096", ".1f"), "mlx-lm, one process"),
)

H200_ROWS = bench_rows(H200) + local_rows(H200) + (
    Row("decode tok/s, one machine, every expert local, alternated with mlx-lm round by round "
        "(medians of 3 rounds)", Cell(ONE_MACHINE, "figures.shoal_one_mac_all_local"),
        Cell(ONE_MACHINE, "baselines.mlx_lm_single"), "mlx-lm, one process"),
    Row("the same, each round's ratio", Cell(ONE_MACHINE, "ratios_by_round", ".2f")),
    Row("decode tok/s, one machine, every expert local, MLX's CUDA graphs on (a coordinator "
        "without workers keeps MLX's default: `engine/process.py`)",
        Cell((H200, "all-local-graphs"), "figures.graphs_on"),
        Cell((H200, "all-local-graphs"), "baselines.mlx_lm_single"), "mlx-lm, one process"),
    Row("the same with graphs off, as every Shoal process had them before",
        Cell((H200, "all-local-graphs"), "figures.graphs_off"),
        Cell((H200, "all-local-graphs"), "figures.graphs_on"), "graphs on"),
    Row("decode tok/s, lane against gRPC (alternated, one device call)",
        Cell((H200, "lane-vs-grpc"), "figures.lane.tok_s"),
        Cell((H200, "lane-vs-grpc"), "baselines.grpc.tok_s"), "gRPC stream"),
    Row("the wire, us a layer, lane against gRPC (same call)",
        Cell((H200, "lane-vs-grpc"), "figures.lane.wire_us", ".0f"),
        Cell((H200, "lane-vs-grpc"), "baselines.grpc.wire_us", ".0f"), "gRPC stream"),
    Row("decode tok/s, lane, against the floor of any design leaving the GPU at every MoE "
        "layer (mlx-lm, one process, synced through host memory; same call)",
        Cell((H200, "lane-vs-grpc"), "figures.lane.tok_s"),
        Cell((H200, "sync-floor"), "figures.sync_host.decode_tps"), "floor"),
    Row("the floor's steps: plain / synced at each MoE layer / through host memory",
        (Cell((H200, "sync-floor"), "figures.plain.decode_tps"),
         Cell((H200, "sync-floor"), "figures.sync.decode_tps"),
         Cell((H200, "sync-floor"), "figures.sync_host.decode_tps"))),
    Row("decode tok/s with MLX's CUDA graphs off in every process (`engine/process.py`), "
        "alternated", Cell((H200, "graphs-off"), "figures.alloff.tok_s"),
        Cell((H200, "graphs-off"), "baselines.base.tok_s"), "graphs on"),
    Row("the coordinator's wait for attention and router, us a layer, graphs off",
        Cell((H200, "graphs-off"), "figures.alloff.sync_us", ".0f"),
        Cell((H200, "graphs-off"), "baselines.base.sync_us", ".0f"), "graphs on"),
    Row("a kernel's first read of a 4 KB array from host bytes, us, with the GPU told it "
        "reads it (`engine/tensors.py`)",
        Cell((H200, "host-arrays"), "figures.4096.first_read_advised", ".0f"),
        Cell((H200, "host-arrays"), "figures.4096.first_read_of_host_array", ".0f"),
        "not told"),
    Row("largest difference from mlx-lm's logits, forwards of 1 / 2 / 8 / 64 tokens",
        tuple(Cell((H200, "alone-diagnosis"), f"figures.forward_tokens.{n}", ".1f")
              for n in (1, 2, 8, 64))),
)

def call_cost(label: str, name: str) -> Row:
    """One part of a layer call in process, after the cuts against before (alternated)."""
    slot = (CPU, "call-costs")
    return Row(label, Cell(slot, f"figures.{name}", ".0f"), Cell(slot, f"baselines.{name}", ".0f"),
               "before the cuts")


PREFILL, INTERLEAVE = (CPU, "bench-quick-prefill"), (CPU, "long-prompts-quick")
INTERLEAVE_GQA = (CPU, "long-prompts-quick-qwen3_moe")


def prefill_rows(slot: Slot, what: str) -> tuple[Row, ...]:
    """Prefill of 512 and 4,096 tokens over two workers against mlx-lm in one process."""
    return tuple(Row(f"prefill tok/s, {n:,}-token prompt, two workers, {what}",
                     Cell(slot, f"{SHOAL}.prefill_tps.{n}"), Cell(slot, f"{MLX}.prefill_tps.{n}"),
                     "mlx-lm, one process") for n in (512, 4096))


def interleave_rows(slot: Slot, what: str) -> tuple[Row, ...]:
    """`shoal serve` while a 4,096-token prompt arrives beside four decoding streams."""
    return (
        Row(f"serve, {what}, 4 streams decoding while a 4,096-token prompt is prefilled: their "
            "longest gap between tokens (ms)", Cell(slot, "figures.gap_longest_during_ms", ".0f"),
            Cell(slot, "figures.gap_median_before_ms", ".1f"), "their median gap before"),
        Row("the same: their median gap while it is prefilled (ms)",
            Cell(slot, "figures.gap_median_during_ms", ".1f"),
            Cell(slot, "figures.gap_median_before_ms", ".1f"), "median gap before"),
        Row("the same: the long prompt's time to first token (s)",
            Cell(slot, "figures.ttft_beside_streams_s", ".2f"),
            Cell(slot, "figures.ttft_alone_s", ".2f"), "alone"),
        Row("the same: the machine's load average (1 min) before and after",
            Cell(slot, "figures.load_average", ".1f")),
    )


PIECES = (CPU, "prefill-pieces")

CPU_ROWS = bench_rows(CPU) + prefill_rows(PREFILL, "tiny checkpoint") + tuple(
    Row(f"prefill tok/s, {n:,}-token prompt, two workers, a pass's layer calls sent in pieces "
        "(alternated with whole, 3 rounds, `benchmarks/probes/prefill_pieces.py`)",
        Cell(PIECES, f"figures.pieces.{n}", ".0f"), Cell(PIECES, f"baselines.whole.{n}", ".0f"),
        "each worker's share whole") for n in (512, 4096)) + tuple(
    Row(f"prefill tok/s, {n:,}-token prompt, two workers, the pass pipelined over chunks of "
        "256 tokens (the same run)", Cell(PIECES, f"figures.pipelined.{n}", ".0f"),
        Cell(PIECES, f"baselines.mlx_lm_single.{n}", ".0f"), "mlx-lm, one process")
    for n in (512, 4096)) + interleave_rows(INTERLEAVE, "tiny checkpoint (latent attention)") \
    + interleave_rows(INTERLEAVE_GQA, "tiny qwen3_moe (grouped-query attention)") + (
    Row("tiny checkpoint: a layer's overhead beyond the slowest worker (ms), lane against "
        "gRPC", Cell((CPU, "bench-quick"), "layer_overhead_ms", ".2f"),
        Cell((CPU, "bench-quick-grpc"), "layer_overhead_ms", ".2f"), "gRPC stream"),
    *(call_cost(label, name) for label, name in (
        ("the coordinator's send, us a decode layer call, in process", "send_us"),
        ("the coordinator's parse and scatter, us a decode layer call", "parse_scatter_us"),
        ("a worker's decode request: validating it, us", "validate_us"),
        ("a worker's decode request: building the call, us", "build_us"))),
)

BREAKDOWN = (("sync", "the coordinator's wait for attention and router"),
             ("send", "group, build and write the requests"),
             ("wire", "the critical worker's round trip less its own time"),
             ("worker_parse", "the worker reads the request"),
             ("worker_bookkeeping", "the worker's bookkeeping"),
             ("worker_matrix", "the worker's matrix work"),
             ("worker_reply", "the worker writes its reply"),
             ("parse_scatter", "the coordinator reads the replies and puts rows in place"),
             ("round_trip", "the layer call, end to end"))


def breakdown(records: Records) -> list[str]:
    lines = ["| part of one MoE layer call in decode | H200, us | CPU, us |", "|---|---:|---:|"]
    for part, meaning in BREAKDOWN:
        key = f"{SHOAL}.dispatch.breakdown.{part}_us"
        h200, cpu = (shown(figure(records, Cell((m, "bench"), key)), ".0f") for m in (H200, CPU))
        lines.append(f"| {part} ({meaning}) | {h200} | {cpu} |")
    return lines + ["", f"From {source(records, [(H200, 'bench'), (CPU, 'bench')])}."]


# The projection's stated inputs: (value, unit, why). Measured ones come from the H200 record.
STATED = {
    "link_us": (300, "us", "a TCP round trip over Thunderbolt Bridge between two Macs, "
                "small messages (stated, not measured here)"),
    "bandwidth_gbs": (800, "GB/s", "an M3 Ultra's memory bandwidth (Apple's figure; the "
                      "peak, so optimistic)"),
    "expert_mb": (24.8, "MB", "one DeepSeek-V3 routed expert in 4 bits, group 64 "
                  "(3 x 7168 x 2048 weights at 4.5 bits)"),
    "dense_mb": (131, "MB", "DeepSeek-V3's dense weights per layer in 4 bits (attention, "
                 "router, shared expert: about 233M weights)"),
}
MODELS = (("DeepSeek-V3", 58, 8), ("Kimi K2", 60, 8))  # name, MoE layers, routed experts a token
MEASURED = (("sync", "the coordinator's fixed cost to reach the router's choice"),
            ("send", "building and writing the requests"),
            ("parse_scatter", "reading the replies"),
            ("worker_parse", "a worker reading a request"),
            ("worker_bookkeeping", "a worker's bookkeeping"),
            ("worker_reply", "a worker writing its reply"))


def projection(records: Records) -> list[str]:
    """t_token = L x (fixed + dense_bytes / bw + link + experts_bytes / (workers x bw)), with
    fixed the H200's measured per-layer costs outside matrix work and the wire."""
    key = f"{SHOAL}.dispatch.breakdown"
    measured = {p: figure(records, Cell((H200, "bench"), f"{key}.{p}_us"))[0]
                for p, _ in MEASURED}
    fixed = sum(measured.values())
    link, bw = STATED["link_us"][0], STATED["bandwidth_gbs"][0]
    dense = STATED["dense_mb"][0] / bw * 1e3  # MB / (GB/s) = ms; in us
    lines = ["| input | value | stated or measured |", "|---|---:|---|"]
    lines += [f"| {p} ({meaning}) | {v:.0f} us | measured, H200 record |"
              for (p, meaning), v in zip(MEASURED, measured.values(), strict=True)]
    lines += [f"| {name} | {v} {unit} | {why} |" for name, (v, unit, why) in STATED.items()]
    lines += ["", "| model | MoE layers | workers | per layer | per token | tok/s |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, layers, k in MODELS:
        for workers in (2, 4):
            # the busiest worker holds about k / workers of a token's experts, rounded up
            experts = -(-k // workers) * STATED["expert_mb"][0] / bw * 1e3
            layer = fixed + dense + link + experts
            lines.append(f"| {name} | {layers} | {workers} | {layer / 1e3:.2f} ms | "
                         f"{layers * layer / 1e3:.0f} ms | {1e6 / (layers * layer):.1f} |")
    return lines + ["", f"Measured inputs from {source(records, [(H200, 'bench')])}."]


def mean_of(records: Records, cell: Cell) -> float:
    return statistics.mean(figure(records, cell))


def ratio_of(ours: Cell, theirs: Cell) -> Callable[[Records], float]:
    return lambda r: mean_of(r, ours) / mean_of(r, theirs)


H200_BENCH, LANES, FLOOR = (H200, "bench"), (H200, "lane-vs-grpc"), (H200, "sync-floor")
H200_BREAKDOWN = f"{SHOAL}.dispatch.breakdown"
# (what, how it is measured, at least or at most, the bound, its unit)
TARGETS: tuple[tuple[str, Callable[[Records], float], str, float, str], ...] = (
    ("decode on the lane against the gRPC stream (same call)",
     ratio_of(Cell(LANES, "figures.lane.tok_s"), Cell(LANES, "baselines.grpc.tok_s")),
     ">=", 1.4, "x"),
    ("decode against the sync floor through host memory (same call)",
     ratio_of(Cell(LANES, "figures.lane.tok_s"), Cell(FLOOR, "figures.sync_host.decode_tps")),
     ">=", 0.8, "x"),
    ("the wire part of a decode layer call against a bare lane echo of its sizes",
     lambda r: (mean_of(r, Cell(H200_BENCH, f"{H200_BREAKDOWN}.wire_us")) / 1e3
                / mean_of(r, Cell(H200_BENCH, f"{SHOAL}.echo.lane_round_trip_ms"))),
     "<=", 2.0, "x"),
    ("the coordinator's send plus parse and scatter, a decode layer call in the cluster",
     lambda r: (mean_of(r, Cell(H200_BENCH, f"{H200_BREAKDOWN}.send_us"))
                + mean_of(r, Cell(H200_BENCH, f"{H200_BREAKDOWN}.parse_scatter_us"))),
     "<=", 150, " us"),
    ("prefill of 512 tokens against mlx-lm in one process",
     ratio_of(Cell(H200_BENCH, f"{SHOAL}.prefill_tps.512"),
              Cell(H200_BENCH, f"{MLX}.prefill_tps.512")), ">=", 0.5, "x"),
    ("one local store + one worker against two workers, decode",
     ratio_of(Cell(H200_BENCH, "figures.shoal_one_local_one_remote.decode_tps"),
              Cell(H200_BENCH, f"{SHOAL}.decode_tps")), ">=", 1.3, "x"),
    ("every expert local and resident against mlx-lm in one process, decode, alternated",
     ratio_of(Cell(ONE_MACHINE, "figures.shoal_one_mac_all_local"),
              Cell(ONE_MACHINE, "baselines.mlx_lm_single")), ">=", 0.97, "x"),
)


def targets(records: Records) -> list[str]:
    lines = ["| target (H200 machine) | bound | measured | |", "|---|---:|---:|---|"]
    for what, measure, sense, bound, unit in TARGETS:
        got = measure(records)
        met = got >= bound if sense == ">=" else got <= bound
        shown_got = f"{got:.0f}" if unit == " us" else f"{got:.2f}"
        lines.append(f"| {what} | {sense} {bound:g}{unit} | {shown_got}{unit} | "
                     f"{'met' if met else 'not met'} |")
    return lines


BLOCKS = {
    "h200": lambda r: table(r, H200_ROWS),
    "h100": lambda r: table(r, H100_ROWS),
    "cpu": lambda r: table(r, CPU_ROWS),
    "breakdown": breakdown,
    "projection": projection,
    "targets": targets,
}


def render(text: str, records: Records) -> str:
    """The doc with every rendered block filled again from the records."""
    def fill(match: re.Match) -> str:
        name = match.group(2)
        if name not in BLOCKS:
            raise MissingFigure(f"docs/benchmarks.md names a block {name!r} that has no table")
        return match.group(1) + "\n".join(BLOCKS[name](records)) + "\n" + match.group(3)

    return BLOCK.sub(fill, text)


def render_docs(doc: Path = DOC, folder: Path | None = None) -> Path:
    doc.write_text(render(doc.read_text(), newest(folder or results_folder())))
    return doc
