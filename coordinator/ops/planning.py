"""`shoal plan`: the placement planner as a what-if tool, sizes and workers read from the
command line and its answer shown; its exit status is the verdict, so scripts can ask "does
this model fit these Macs?"."""

from __future__ import annotations

import re
import sys

from engine.cache_policy import format_bytes, parse_budget
from engine.errors import InvalidInput, ShoalError
from engine.placement import WorkerCapacity

# Exit status of `shoal plan` for each verdict (2 stays "bad input", as for every command).
VERDICT_EXIT = {"fits": 0, "streams": 3, "does not fit": 4}


# Sizes as drives are sold: decimal. G, T, GiB, TiB and the like stay binary, as everywhere
# else in Shoal (--memory-budget).
_DECIMAL = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT])B\s*$", re.IGNORECASE)
_DECIMAL_UNITS = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def parse_size(text: str) -> int:
    """Bytes of '192G' or '2T' (binary: GiB, TiB), '2TB' or '500GB' (decimal, as an SSD's
    size is sold), '1.5TiB', or a plain number of bytes."""
    if match := _DECIMAL.match(text):
        return int(float(match.group(1)) * _DECIMAL_UNITS[match.group(2).upper()])
    spec = parse_budget(text)
    if spec.bytes is None:
        raise InvalidInput(f"{text!r}: give a size, not a percentage")
    return spec.bytes


def parse_worker_capacity(text: str) -> WorkerCapacity:
    """NAME=MEMORY[:DISK], sizes like 192G, 1.5T or 2TB (see parse_size)."""
    name, _, sizes = text.partition("=")
    memory, _, disk = sizes.partition(":")
    if not name or not memory:
        raise InvalidInput(f"--worker {text!r} is not NAME=MEMORY[:DISK], e.g. studio=192G:2TB")
    try:
        budget = [parse_size(s) for s in (memory, disk) if s]
    except ShoalError:
        raise InvalidInput(f"--worker {text!r}: sizes look like 64G, 512M, 2T (binary) or "
                           "2TB (decimal)") from None
    return WorkerCapacity(name, budget[0], budget[1] if len(budget) > 1 else None)


def machines(count: int, *, word_only: bool = False, platform: str = sys.platform) -> str:
    """'2 Macs' on macOS, '2 machines' elsewhere ('1 Mac', 'Mac' with `word_only`): the
    planned members are called what this platform calls its computers."""
    word = "Mac" if platform == "darwin" else "machine"
    if word_only:
        return word
    return f"{count} {word}{'' if count == 1 else 's'}"


def both_units(count: int) -> str:
    """A size in decimal and binary units, each named: '2.00 TB = 1.82 TiB'."""
    for decimal, binary, unit in (("TB", "TiB", 4), ("GB", "GiB", 3), ("MB", "MiB", 2)):
        if count >= 1000**unit or unit == 2:
            return (f"{count / 1000**unit:.2f} {decimal} = {count / 1024**unit:.2f} {binary}")
    return f"{count} B"


def print_plan(report: dict) -> None:
    gib = 2**30
    m = report["model"]
    source = "estimated from its config" if m["estimated_from_config"] else "from its manifest"
    print(f"model {m['model_type']} ({source}): {m['experts']} experts, "
          f"{m['expert_bytes'] / gib:.1f} GiB of experts, {m['dense_bytes'] / gib:.1f} GiB "
          f"dense (on the coordinator), top-{m['top_k']}; heat {report['heat']}")
    if m["precision"]:
        bits = m["expert_bits_per_weight"]
        per_weight = f" ({bits:.2f} bits per expert weight)" if bits else ""
        print(f"weights: {m['precision']}{per_weight}")
    if m["source_bytes"]:
        how = "estimated from its config" if m["estimated_from_config"] else "its weight files"
        print(f"download: {both_units(m['source_bytes'])} ({how})")
    if m["estimated_from_config"]:
        print(f"the split `shoal shard` writes: {both_units(m['split_bytes'])} (dense part and "
              "experts together; OUT_DIR's drive needs this much free)")
    if not report["fits"]:
        print(f"does not fit: {report['reason']}")
        print_advice(report)
        return
    where = "in memory" if report["resident"] else "only by streaming experts from disk"
    print(f"fits {where}")
    print(f"  {'worker':<16} {'memory':>10} {'disk':>26} {'experts':>8} {'GiB':>8} "
          f"{'replicas':>9}")
    for name, w in report["workers"].items():
        disk = "-" if w["disk"] is None else both_units(w["disk"])
        print(f"  {name:<16} {format_bytes(w['memory']):>10} {disk:>26} {w['experts']:>8} "
              f"{w['bytes'] / gib:>8.1f} {w['replica_copies']:>9}")
    print(f"predicted imbalance (busiest worker / mean, per layer): "
          f"{report['imbalance_before']:.2f} before, {report['imbalance_after']:.2f} after "
          f"({len(report['replicas'])} experts replicated)")
    a = report["decode_bound"]["assumptions"]
    assumed = (f"{a['memory_gbps']:.0f} GB/s memory, {a['disk_gbps']:.0f} GB/s disk, "
               f"{a['round_trip_ms']:.2f} ms network round trip per MoE layer")
    row = all_members_row(report)
    if row is not None:  # one model: the forecast's figure with its own bound
        print(f"decode {forecast_words(row)}, by the streaming forecast below; assuming "
              f"{assumed}")
    else:
        print(f"decode at most ~{report['decode_bound']['tokens_per_second']:.1f} tokens/s, "
              f"assuming {assumed}, and compute that keeps up with memory")
    print_advice(report)


def all_members_row(report: dict) -> dict | None:
    """The streaming forecast's row for every planned member, where one was made and fits."""
    rows = (report.get("streaming") or {}).get("rows", ())
    row = max(rows, key=lambda r: r["macs"], default=None)
    return row if row is not None and row["fits"] and row["macs"] == len(report["workers"]) \
        else None


def forecast_words(row: dict) -> str:
    """'~0.25 tokens/s (at most ~3.10 were every expert in memory)': a figure and its bound."""
    if not row["read_bytes_per_token"]:
        return f"~{row['tokens_per_second']:.2f} tokens/s (every expert in memory)"
    return (f"~{row['tokens_per_second']:.2f} tokens/s (at most "
            f"~{row['ceiling_tokens_per_second']:.2f} were every expert in memory)")


def print_advice(report: dict) -> None:
    for line in report.get("advice", ()):
        print(f"hint: {line}")
