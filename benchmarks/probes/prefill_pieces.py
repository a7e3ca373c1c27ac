"""What do a prompt pass's layer calls sent in pieces (a worker computes one while the next
arrives: call_plan.PIECE_PAIRS) and the pass pipelined over micro-chunks (pipelined_prefill.py)
each buy? Two local workers, alternated round by round, mlx-lm in one process beside."""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from benchmarks.baselines import measure_single
from benchmarks.checkpoints import QUICK, WORKERS, bench_files
from benchmarks.measure import bench_prompt, timed_generation
from benchmarks.records import write_record
from coordinator.dataplane.call_plan import PIECE_PAIRS
from coordinator.decoding.generate import generate, open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.process import launch_directly


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.prefill_pieces",
        description="Prefill tok/s over two local workers: a prompt pass's layer calls in "
        "pieces, whole, and the pass pipelined over micro-chunks, alternated, beside mlx-lm in "
        "one process (tiny checkpoint)")
    parser.add_argument("--lengths", default="512,4096", help="prompt lengths (512,4096)")
    parser.add_argument("--rounds", type=int, default=3, help="alternations (default 3)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    launch_directly()
    source, sharded, secret_file, log_dir = bench_files(True)
    single = measure_single(source, {**QUICK, "lengths": lengths, "runs": args.rounds,
                                     "long_runs": args.rounds})
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret_file,
                            log_dir)
    variants = {"pieces": PIECE_PAIRS, "whole": 0, "pipelined": PIECE_PAIRS}
    rates: dict[str, dict[str, list[float]]] = {v: {str(n): [] for n in lengths}
                                                 for v in variants}
    loads = []
    try:
        remote = open_remote_model(sharded, [w.address for w in workers],
                                   load_secret(secret_file))
        try:
            vocab = remote.manifest.config["vocab_size"]
            prompt = bench_prompt(vocab, max(lengths))
            for n in lengths:  # warm-up: each shape once
                timed_generation(remote.model, remote.tokenizer, prompt[:n], 1)
            for _ in range(args.rounds):
                for name, pairs in variants.items():
                    remote.dispatcher.piece_pairs = pairs
                    for n in lengths:
                        loads.append(os.getloadavg()[0])
                        if name == "pipelined":
                            tps = generate(remote.model, remote.tokenizer, prompt[:n],
                                           max_tokens=1, dispatcher=remote.dispatcher
                                           ).prefill_tps
                        else:
                            tps, _ = timed_generation(remote.model, remote.tokenizer,
                                                      prompt[:n], 1)
                        rates[name][str(n)].append(tps)
        finally:
            remote.close()
    finally:
        stop_workers(workers)
    for n in lengths:
        key = str(n)
        print(f"prefill {n}: pieces {statistics.median(rates['pieces'][key]):.0f} tok/s, "
              f"whole {statistics.median(rates['whole'][key]):.0f}, pipelined "
              f"{statistics.median(rates['pipelined'][key]):.0f}, mlx-lm one process "
              f"{single['prefill_tps'][key]:.0f} (load average {min(loads):.1f}-"
              f"{max(loads):.1f})", file=sys.stderr)
    write_record(what="prefill-pieces", figures={"pieces": rates["pieces"],
                                                 "pipelined": rates["pipelined"]},
                 baselines={"whole": rates["whole"], "mlx_lm_single": single["prefill_tps"]},
                 load_average=loads, piece_pairs=PIECE_PAIRS)


if __name__ == "__main__":
    main()
