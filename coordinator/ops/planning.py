"""`shoal plan`: the placement planner as a what-if tool, sizes and workers read from the
command line and its answer shown; its exit status is the verdict, so scripts can ask "does
this model fit these Macs?"."""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from coordinator.cluster.discovery import read_cluster_config
from coordinator.ops.heat_record import decode_record, record_path
from engine.cache_policy import format_bytes, parse_budget
from engine.errors import InvalidInput, NotFound, ShoalError
from engine.heat import read_heat
from engine.manifest import ExpertKey, Manifest, expert_file_name
from engine.placement import WorkerCapacity
from engine.sizes import top_k_of
from engine.stream_placement import cold_reads, member_hot_sets

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
    """NAME=MEMORY[:DISK[:READ]], sizes like 192G, 1.5T or 2TB (see parse_size), the drive's
    read speed like 40MB/s (see parse_read_speed)."""
    name, _, sizes = text.partition("=")
    memory, _, rest = sizes.partition(":")
    disk, _, read = rest.partition(":")
    if not name or not memory:
        raise InvalidInput(f"--worker {text!r} is not NAME=MEMORY[:DISK[:READ]], e.g. "
                           "studio=192G:2TB or studio=192G:2TB:5GB/s")
    try:
        budget = [parse_size(s) for s in (memory, disk) if s]
    except ShoalError:
        raise InvalidInput(f"--worker {text!r}: sizes look like 64G, 512M, 2T (binary) or "
                           "2TB (decimal)") from None
    try:
        speed = parse_read_speed(read) / 1e9 if read else None
    except ShoalError as e:
        raise InvalidInput(f"--worker {text!r}: {e}") from None
    return WorkerCapacity(name, budget[0], budget[1] if disk else None, speed)


_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMG])(i?)B/s\s*$", re.IGNORECASE)


def parse_read_speed(text: str) -> float:
    """Bytes/s of a drive's read speed: '40MB/s', '1.5GB/s' (decimal, as drives are quoted),
    '400MiB/s' (binary)."""
    match = _RATE.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InvalidInput(f"{text!r} is not a read speed such as 40MB/s or 1.5GB/s")
    power = "KMG".index(match.group(2).upper()) + 1
    return float(match.group(1)) * (1024 if match.group(3) else 1000) ** power


def parse_member(text: str, *, live: bool = False) -> WorkerCapacity:
    """NAME=MEMORY:READ, e.g. a=24G:40MB/s: a member's memory budget for experts (what its
    shoal-worker gets as --memory-budget) and its drive's read speed. `live` (rebalance): the
    memory may be left out (a=:40MB/s), the worker reports its own."""
    name, _, rest = text.partition("=")
    memory, _, read = rest.partition(":")
    if not name or not (memory or live) or not read:
        raise InvalidInput(f"--member {text!r} is not NAME=MEMORY:READ, e.g. a=24G:40MB/s")
    return member_capacity(name, memory, read, f"--member {text!r}")


def live_members(
    members: Sequence[str] | None, cluster_config: Path | None
) -> list[WorkerCapacity]:
    """What `shoal rebalance` is told of the live workers: --member flags (memory optional),
    then a cluster config's [[workers]] read_speed (and memory_budget) where given."""
    given = [parse_member(text, live=True) for text in members or ()]
    named = {m.name for m in given}
    if cluster_config:
        for name, memory, read in read_cluster_config(cluster_config).members:
            if read and name not in named:
                given.append(member_capacity(name, memory or "", read,
                                             f"{cluster_config}: worker {name}"))
    return given


def member_capacity(name: str, memory: str, read: str, where: str) -> WorkerCapacity:
    """A member's capacity from its memory budget (empty: 0, unknown) and read speed."""
    try:
        budget = parse_size(memory) if memory else 0
    except ShoalError:
        raise InvalidInput(f"{where}: the memory budget looks like 24G or 512M, not "
                           f"{memory!r}") from None
    try:
        speed = parse_read_speed(read)
    except ShoalError as e:
        raise InvalidInput(f"{where}: {e}") from None
    return WorkerCapacity(name, budget, None, speed / 1e9)


def placement_members(
    members: Sequence[str] | None, cluster_config: Path | None
) -> list[WorkerCapacity]:
    """The members `shoal shard` places for: --member NAME=MEMORY:READ flags, or a cluster
    config's [[workers]] with memory_budget and read_speed; [] when neither is given."""
    if members and cluster_config:
        raise InvalidInput("give the members as --member or in --cluster-config, not both")
    if members:
        parsed = [parse_member(text) for text in members]
    elif cluster_config:
        config = read_cluster_config(cluster_config)
        lacking = [name for name, memory, read in config.members if not (memory and read)]
        if lacking or not config.members:
            raise InvalidInput(
                f"{cluster_config}: to place by it, give every [[workers]] table "
                f'memory_budget = "24G" and read_speed = "40MB/s" (missing for '
                f"{', '.join(lacking) or 'every worker'})")
        parsed = [member_capacity(name, memory, read, f"{cluster_config}: worker {name}")
                  for name, memory, read in config.members]
    else:
        return []
    names = [m.name for m in parsed]
    if len(set(names)) != len(names):
        raise InvalidInput(f"member names must be unique, got {', '.join(names)}")
    return parsed


def shard_heat(path: Path | None, out_dir: Path) -> dict[ExpertKey, float] | None:
    """The heat to place by: a file (`shoal heat --json`'s JSON, or a heat.msgpack record),
    else the record of the split in OUT_DIR that --force replaces, else None (uniform)."""
    if path is None:
        path = record_path(out_dir)
        if not path.is_file():
            return None
    if path.suffix != ".msgpack":
        return read_heat(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"heat file {path} does not exist") from None
    total = decode_record(data, origin=str(path)).total()
    return {key: float(count) for key, count in total.items()} or None


def member_lines(
    members: Sequence[WorkerCapacity], manifest: Manifest, out_dir: Path,
    heat: Mapping[ExpertKey, float] | None, spare: float,
) -> list[str]:
    """What each member's store holds, what of it stays in memory and its share of the cold
    reads, and the worker command that matches the plan (its --memory-budget)."""
    sizes = {(e.layer, e.expert): e.bytes for e in manifest.experts}
    stores = [out_dir / f"worker-{k}" for k in range(len(members))]
    holders: dict[ExpertKey, list[str]] = {key: [] for key in sizes}
    for member, store in zip(members, stores, strict=True):
        for key in sizes:
            if (store / expert_file_name(*key)).is_file():
                holders[key].append(member.name)
    weights = dict(heat) if heat else dict.fromkeys(sizes, 1.0)
    top_k = top_k_of(manifest.config)
    memory = {m.name: int(m.memory * (1 - spare)) for m in members}
    hot = member_hot_sets(holders, memory, sizes, weights, top_k=top_k)
    reads = cold_reads(holders, memory, sizes, weights, top_k=top_k)
    cold = {m.name: sum(layer.get(m.name, 0.0) for layer in reads.values()) for m in members}
    streams = sum(memory.values()) < sum(sizes.values())
    lines = [f"placed for {'streaming' if streams else 'memory'} over {len(members)} members "
             f"(heat {'recorded' if heat else 'uniform'}):"]
    for member, store in zip(members, stores, strict=True):
        held = sum(sizes[k] for k, names in holders.items() if member.name in names)
        hot_bytes = sum(sizes[k] for k in hot[member.name])
        share = cold[member.name] / sum(cold.values()) if sum(cold.values()) else 0.0
        lines.append(f"  {store.name} = {member.name}: {format_bytes(held)}, "
                     f"{format_bytes(hot_bytes)} of it in memory (budget "
                     f"{format_bytes(member.memory)} less {spare:.0%} spare), {share:.0%} of "
                     f"the cold reads at {member.read_gbps * 1000:g} MB/s")
    lines.append("next, on each member (with its store copied there): the budget the plan "
                 "assumes")
    for member, store in zip(members, stores, strict=True):
        lines.append(f"  {member.name}: shoal-worker --store {store} --memory-budget "
                     f"{budget_words(member.memory)}")
    return lines


def budget_words(count: int) -> str:
    """A byte count as --memory-budget takes it: '24G', '1536M', or plain bytes."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if count % size == 0:
            return f"{count // size}{unit}"
    return str(count)


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
