"""Every mlx-lm MoE family, served by two real workers, and again by one worker with the
other store served by the coordinator in its own process, gives mlx-lm's own greedy ids.

The families come from mlx-lm's models folder at run time (builders/families.py `discover`), so a
family that a new mlx-lm adds fails here with "no tiny config for X" until it has one. Each case
builds the family's tiny random checkpoint, shards it over two stores, starts a worker on each
and decodes greedily through them. A family whose mlx-lm code cannot run on this machine is
sharded and served, its experts' inventory checked, and then skipped with the reason.

With SHOAL_FAMILIES_REPORT=FILE each case appends its outcome to FILE as a JSON line;
scripts/families_doc.py runs the sweep that way and writes the table in docs/models.md.
"""

import contextlib
import io
import json
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from mlx_lm.utils import load_model

from builders.families import TINY, discover
from builders.synthetic import build_checkpoint
from builders.synthetic_config import all_families
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import LocalWorker, start_worker, stop_workers
from engine.auth import load_secret
from engine.sharding import shard
from tests.integration.test_equivalence import GROUP_SIZE, NEW_TOKENS, PROMPT, greedy_tokens

WORKERS = 2
QUANTIZE_BITS = 4
REPORT = os.environ.get("SHOAL_FAMILIES_REPORT")


def _cases() -> list:
    cases = []
    for family in discover():
        cases.append(pytest.param(family, None, id=f"{family}-f32"))
        if family in TINY and TINY[family].quantized:
            cases.append(pytest.param(family, QUANTIZE_BITS, id=f"{family}-q{QUANTIZE_BITS}"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("family,bits", _cases())
def test_family_matches_mlx_lm(family, bits, tmp_path, secret_file):
    started = time.monotonic()
    try:
        outcome = _check_family(family, bits, tmp_path, secret_file)
    except BaseException as error:  # recorded, then raised: skips and failures alike
        _record(family, bits, _outcome_of(error), time.monotonic() - started)
        raise
    _record(family, bits, outcome, time.monotonic() - started)


def _check_family(family, bits, tmp_path: Path, secret_file: Path) -> str:
    if family not in all_families():
        pytest.fail(f"no tiny config for {family}: add one to builders/families.py TINY")
    tiny = TINY[family]
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its quantization
        source = build_checkpoint(tmp_path / "source", family, quantize_bits=bits,
                                  group_size=GROUP_SIZE)
    sharded = tmp_path / "sharded"
    manifest = shard(source, sharded, workers=WORKERS, progress=False)
    stores = [sharded / f"worker-{k}" for k in range(WORKERS)]
    with _workers(stores, secret_file, tmp_path) as ready:
        # mlx-lm's own ids while the workers start (their start is mostly imports).
        expected = greedy_tokens(load_model(source)[0], PROMPT, NEW_TOKENS) \
            if tiny.runs_here() else None
        workers = ready()
        remote = open_remote_model(sharded, [w.address for w in workers],
                                   load_secret(secret_file))
        try:
            held = frozenset().union(*remote.cluster.holdings)
            every = {(e.layer, e.expert) for e in manifest.experts}
            assert held == every, f"the workers hold {len(held)} of {len(every)} experts"
            if expected is None:
                pytest.skip(f"{family}: {tiny.needs_metal}; sharded and served ({len(every)} "
                            f"experts on {WORKERS} workers), no reference ids here")
            tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
            served = remote.dispatcher.stats.worker_requests
        finally:
            remote.close()
        # and with the first store served by the coordinator itself, in process: a store is
        # served by one process at a time (engine/store_lock.py), so its worker stops first
        stop_workers(workers[:1])
        beside = open_remote_model(sharded, [workers[1].address], load_secret(secret_file),
                                   local_stores=[stores[0]])
        try:
            local_tokens = greedy_tokens(beside.model, PROMPT, NEW_TOKENS)
            local_served = beside.dispatcher.stats.worker_requests
        finally:
            beside.close()
    assert tokens == expected, f"{family}: Shoal gave {tokens}, mlx-lm {expected}"
    assert all(served[w.address] > 0 for w in workers), served
    assert local_tokens == expected, f"{family}, one store local: {local_tokens}, {expected}"
    assert local_served["local"] > 0 and local_served[workers[1].address] > 0, local_served
    return "exact"


@contextlib.contextmanager
def _workers(
    stores: list[Path], secret_file: Path, logs: Path
) -> Iterator[Callable[[], list[LocalWorker]]]:
    """Start one worker per store in the background; yield a function that waits until all
    serve. Every worker that started is stopped by PID at the end. The workers are forked
    from one that has imported shoal-worker already: a start costs ~0.2 s, not ~2 s of
    imports, which was most of each case's time."""
    pool = ThreadPoolExecutor(len(stores))
    starts = [pool.submit(start_worker, [store], secret_file, logs / f"worker-{k}.log",
                          ("--no-advertise",), forked=True) for k, store in enumerate(stores)]
    try:
        yield lambda: [start.result() for start in starts]
    finally:
        pool.shutdown(wait=True)  # each start is bounded by its own timeout
        stop_workers([start.result() for start in starts if start.exception() is None])


def _outcome_of(error: BaseException) -> str:
    if isinstance(error, pytest.skip.Exception):
        return f"served, no reference: {error}"
    # The first line says what failed; a worker's log (after it) ends with why.
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    lines = lines or [type(error).__name__]
    return "fails: " + (lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}")


def _record(family: str, bits, outcome: str, seconds: float) -> None:
    if not REPORT:
        return
    line = {"family": family, "bits": bits, "outcome": outcome, "seconds": round(seconds, 2)}
    with open(REPORT, "a") as out:
        out.write(json.dumps(line) + "\n")
