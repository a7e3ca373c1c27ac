"""Store folders opened for serving: scanned (and verified), their experts held under a memory
budget; a worker's (worker/daemon.py) and the coordinator's own (dataplane/local_experts.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

import mlx.core as mx

from engine.cache_policy import (
    DEFAULT_MEMORY_SHARE,
    BudgetSpec,
    format_bytes,
    parse_budget,
    resolve_budget,
)
from worker.reader import READERS_PER_DRIVE
from worker.residency import Residency
from worker.store import scan_stores


def physical_memory() -> int:
    """Bytes of physical memory (macOS and Linux); 16 GiB where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def choose_budget(memory_budget: str | None, expert_bytes: int) -> tuple[int, str]:
    """The budget in bytes (--memory-budget's text, or None) and how it was chosen, for the
    start-up line."""
    spec = parse_budget(memory_budget) if memory_budget else BudgetSpec()
    physical = physical_memory()
    budget = resolve_budget(spec, expert_bytes, physical)
    how = (f"--memory-budget {memory_budget}" if memory_budget else
           f"default {DEFAULT_MEMORY_SHARE:.0%} of {format_bytes(physical)} physical memory")
    return budget, how


def open_residency(
    stores: list[Path], memory_budget: str | None, *, verify: bool = True,
    readers: int = READERS_PER_DRIVE, verify_reads: bool = True, name: str = "shoal-worker",
    out: TextIO | None = None, warm: bool = True, admission: bool = True,
    read_limit: int | None = None,
) -> Residency:
    """Scan (and verify) store folders and hold their experts under a memory budget
    (--memory-budget's text, or None for the default), saying so as `name` (a worker, or the
    coordinator for its own experts: coordinator/dataplane/local_experts.py), the budget on `out`
    (default stdout), warnings on stderr. `warm`: read the experts that fit into memory now;
    `admission` False: every expert read is kept like a hot one (engine/cache_policy.admit);
    `read_limit`: bytes/s at most from each store folder (worker/reader.py's pacing)."""
    scan = scan_stores(stores, verify=verify)
    for problem in scan.problems:
        print(f"{name}: warning: {problem}", file=sys.stderr, flush=True)
    if not scan.held:
        # A store folder with only the manifest: `shoal deploy` sends the experts.
        print(f"{name}: no intact expert files in {', '.join(map(str, stores))} yet; "
              "waiting for `shoal deploy` to send some", file=sys.stderr, flush=True)
    expert_bytes = scan.expert_bytes()
    budget, how = choose_budget(memory_budget, expert_bytes)
    resident = min(budget, expert_bytes)
    print(
        f"{name}: memory budget {format_bytes(budget)} ({how}); experts "
        f"{format_bytes(expert_bytes)}, {resident / max(expert_bytes, 1):.0%} of them fit in memory"
        + ("" if budget >= expert_bytes else "; the rest are read from the drives when routed"),
        file=out or sys.stdout, flush=True,
    )
    residency = Residency(
        scan, budget=budget, readers_per_drive=readers, verify_reads=verify_reads, warm=warm,
        report=lambda m: print(f"{name}: warning: {m}", file=sys.stderr, flush=True),
    )
    residency.cache.admission = admission
    residency.reader.read_bps = read_limit
    if residency.streaming:
        # Evicted experts' memory goes back to the system instead of MLX's buffer cache.
        mx.set_cache_limit(4 * residency.reader.buffer_bytes)
    return residency
