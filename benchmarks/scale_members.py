"""One point of the scaling benchmark: a member count (or a placed layout) run with each member
a Mac of its own (a cgroup with its memory, read rate and CPU share), the page cache dropped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.measure import greedy_generation
from benchmarks.stream_limits import MemberLimits, drop_page_cache, read_cpu_seconds
from coordinator.decoding.generate import open_remote_model
from coordinator.decoding.report import streaming_report
from coordinator.ops.heat_record import fetch_readings
from coordinator.ops.local_processes import start_worker
from coordinator.ops.worker_stats import read_stats
from engine.auth import load_secret
from engine.manifest import read_manifest

REPO = Path(__file__).resolve().parents[1]
# Room beyond its expert budget that a member process needs (Python, MLX, gRPC, the dense
# model on the coordinator): the cgroup limit catches a member that grows past its budget.
WORKER_SLACK = 768 << 20
COORDINATOR_SLACK = 1536 << 20


def holders_of(sharded: Path, members: int) -> dict[tuple[int, int], tuple[str, ...]]:
    """Which member's store folder holds each expert file (member 0: the coordinator's)."""
    holders: dict[tuple[int, int], tuple[str, ...]] = {}
    for i in range(members):
        for path in (sharded / f"worker-{i}").glob("L*/E*.safetensors"):
            key = (int(path.parent.name[1:]), int(path.stem[1:]))
            holders[key] = (*holders.get(key, ()), f"member-{i}")
    return holders


def placed_stores(whole: Path, holders: dict[tuple[int, int], tuple[str, ...]],
                  out: Path) -> Path:
    """Store folders laid out as `holders` says (member-i -> worker-i), hard links to the files
    of `whole` (a one-member split), its dense part and manifest shared."""
    manifest = read_manifest(whole)
    files = {(e.layer, e.expert): e.file for e in manifest.experts}
    out.mkdir(parents=True, exist_ok=True)
    for name in ("dense", "manifest.json"):
        if not (out / name).exists():
            (out / name).symlink_to(whole / name)
    for name in {name for names in holders.values() for name in names}:
        folder = out / f"worker-{name.split('-')[1]}"
        folder.mkdir(exist_ok=True)
        if not (folder / "manifest.json").exists():
            (folder / "manifest.json").symlink_to(whole / "worker-0" / "manifest.json")
    for key, names in holders.items():
        for name in names:
            target = out / f"worker-{name.split('-')[1]}" / files[key]
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                os.link(whole / "worker-0" / files[key], target)
    return out


def member_once(sharded: str, addresses: list[str], secret_file: str, budget: int,
                ids: list[int], tokens: int, lookahead: bool, cpu_files: list,
                admission: bool = True, read_limit: int | None = None) -> None:
    """The coordinator, in a process (and cgroup) of its own: member 0's store here, the rest
    on the workers at `addresses`; prints one JSON line of decode-only figures, the members'
    CPU seconds (their cgroups' counters, `cpu_files`) taken over the decode too."""
    remote = open_remote_model(Path(sharded), addresses, load_secret(Path(secret_file)),
                               local_stores=[Path(sharded) / "worker-0"],
                               memory_budget=str(budget), admission=admission,
                               read_limit=read_limit)
    if not lookahead:
        remote.dispatcher.lookahead = None
    taken: list = []

    def cpu() -> list[float | None]:
        return [read_cpu_seconds(Path(path) if path else None, v2) for path, v2 in cpu_files]

    def after_first() -> None:
        taken.extend((read_stats(remote.cluster.links), fetch_readings(remote.cluster.links),
                      cpu()))

    try:
        run = greedy_generation(remote.model, remote.tokenizer, ids, tokens, after_first)
        cpu_after = cpu()
        (before, counted, cpu_before), after = taken, read_stats(remote.cluster.links)
        heat: dict[tuple[int, int], int] = {}
        for reading in fetch_readings(remote.cluster.links):
            seen = next((r.counts for r in counted if r.name == reading.name), {})
            for key, count in reading.counts.items():
                heat[key] = heat.get(key, 0) + count - seen.get(key, 0)
        hints = remote.dispatcher.lookahead.stats if remote.dispatcher.lookahead else None
    finally:
        remote.close()
    report = streaming_report(before, after, 0, hints)
    print(json.dumps({
        "tokens": run.tokens, "decode_seconds": run.decode_seconds,
        "heat": [[layer, expert, n] for (layer, expert), n in sorted(heat.items()) if n > 0],
        "cpu_seconds": [None if a is None or b is None else b - a
                        for a, b in zip(cpu_before, cpu_after, strict=True)],
        "hint_precision": report.get("hints", {}).get("precision"),
        "members": {address: {"demands": s["demands"], "hit_rate": s["hit_rate"],
                              "would_miss": s["demands"] - round((s["hit_rate_without_prefetch"]
                                                                  or 0) * s["demands"]),
                              "bytes_read": s["bytes_read"],
                              "drive_seconds": sum(d["active_seconds"] for d in s["drives"])}
                    for address, s in report["workers"].items()},
    }))


def run_point(sharded: Path, members: int, budget: int, read_bps: list[int | None],
              ids: list[int], tokens: int, secret_file: Path, log_dir: Path,
              device: str | None, cpu: float | None, lookahead: bool = True,
              admission: bool = True) -> dict:
    """One layout of `members` members, member i reading at `read_bps[i]` with `cpu` cores:
    page cache dropped, each member in its own cgroup, decode timed; `admission` False: every
    member keeps each expert it reads (`--cache-admission every`). The read rate is each
    member's `--read-limit` as well as its cgroup's: the cgroup throttle lets an expert's read
    after an idle spell through at the device's speed (benchmarks/probes/throttle_burst.py)."""
    how = drop_page_cache(sorted(sharded.glob("worker-*/L*/E*.safetensors")))
    manifest = read_manifest(sharded)
    mean_size = sum(e.bytes for e in manifest.experts) / len(manifest.experts)
    limits, workers = [], []
    try:
        coordinator = MemberLimits(f"shoal-scale-{os.getpid()}-0", budget + COORDINATOR_SLACK,
                                   read_bps[0], device, cpu)
        limits.append(coordinator)
        for i in range(1, members):
            limit = MemberLimits(f"shoal-scale-{os.getpid()}-{i}", budget + WORKER_SLACK,
                                 read_bps[i], device, cpu)
            limits.append(limit)
            workers.append(start_worker([sharded / f"worker-{i}"], secret_file,
                                        log_dir / f"worker-{members}-{i}.log",
                                        ["--memory-budget", str(budget), "--cache-admission",
                                         "heat" if admission else "every",
                                         *(["--read-limit", str(read_bps[i])]
                                           if read_bps[i] else [])],
                                        prefix=limit.wrap([])))
        cpu_files = [[str(limit.cpu_usage), limit.cpu_v2] if limit.cpu_usage else [None, False]
                     for limit in limits]
        code = ("from benchmarks.scale_members import member_once; member_once("
                f"{str(sharded)!r}, {[w.address for w in workers]!r}, {str(secret_file)!r}, "
                f"{budget}, {ids!r}, {tokens}, {lookahead}, {cpu_files!r}, {admission}, "
                f"{read_bps[0]})")
        proc = subprocess.run(coordinator.wrap([sys.executable, "-c", code]), capture_output=True,
                              text=True, timeout=3600, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{members} members: the coordinator failed: "
                             f"{proc.stderr.strip()[-600:]}")
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        drive_bytes = [limit.bytes_read() for limit in limits]
    finally:
        for worker in workers:
            worker.stop()
        for limit in limits:
            limit.close()
    decode, steps = run["decode_seconds"], len(run["tokens"]) - 1
    # Member 0 (the coordinator's own store) first, then the workers in the order started.
    order = [a for a in run["members"] if a not in {w.address for w in workers}]
    order += [w.address for w in workers if w.address in run["members"]]
    stats = [run["members"][a] for a in order]
    demands = sum(s["demands"] for s in stats)
    hits = sum((s["hit_rate"] or 0) * s["demands"] for s in stats)
    return {
        "members": members,
        "tokens": run["tokens"],
        "heat": {(layer, expert): float(n) for layer, expert, n in run["heat"]},
        "tok_s": steps / decode,
        "hit_rate": hits / demands if demands else None,
        "hint_precision": run["hint_precision"],
        "read_bytes_per_token": sum(s["bytes_read"] for s in stats) / steps,
        "demand_bytes_per_token": sum(s["would_miss"] for s in stats) * mean_size / steps,
        "drive_busy": [s["drive_seconds"] / decode for s in stats],
        "cpu_busy": [None if c is None else c / decode for c in run["cpu_seconds"]],
        "cgroup_bytes_read": drive_bytes,
        "page_cache": how,
        "limits": sorted({kind for limit in limits for kind in limit.kinds}),
        "not_set": sorted({m for limit in limits for m in limit.missing}),
    }
