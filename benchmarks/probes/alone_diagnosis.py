"""Where does Shoal's single-sequence output differ from mlx-lm's in one process on a backend?
The switch module with a row's experts split as two workers get them, and one forward of L
tokens through two local workers, each against mlx-lm: a largest difference (0: identical)."""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU
from mlx_lm.utils import load_model

from benchmarks.checkpoints import WORKERS, bench_files
from benchmarks.measure import bench_prompt
from benchmarks.probes.batch_invariance import largest_difference
from coordinator.decoding.generate import open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret

ROWS = (1, 2, 4, 7, 8, 16, 64)
LENGTHS = (1, 2, 4, 7, 8, 9, 16, 32)


def switch_splits(width: int = 1024, hidden: int = 512, experts: int = 64, k: int = 8) -> dict:
    mx.random.seed(0)
    switch = SwitchGLU(width, hidden, experts)
    nn.quantize(switch, group_size=64, bits=4)
    out = {}
    for n in ROWS:
        x = mx.random.normal((n, width))
        inds = mx.stack([mx.random.permutation(experts)[:k] for _ in range(n)]).astype(mx.int32)
        whole = switch(x, inds)
        halves = mx.concatenate([switch(x, inds[:, : k // 2]), switch(x, inds[:, k // 2:])], 1)
        pairs = switch(x[mx.repeat(mx.arange(n), k)], inds.reshape(-1, 1))[:, 0, :]
        out[n] = {"halves": largest_difference(halves, whole),
                  "pairs": largest_difference(pairs.reshape(n, k, -1), whole)}
    return out


def forwards(quick: bool, lengths: tuple[int, ...] = LENGTHS) -> dict:
    source, sharded, secret, logs = bench_files(quick)
    single, _ = load_model(source)
    workers = start_workers([[sharded / f"worker-{k}"] for k in range(WORKERS)], secret, logs)
    out = {}
    try:
        remote = open_remote_model(sharded, [w.address for w in workers], load_secret(secret))
        for length in lengths:
            prompt = mx.array([bench_prompt(remote.manifest.config["vocab_size"], length)])
            out[length] = largest_difference(single(prompt), remote.model(prompt))
        remote.close()
    finally:
        stop_workers(workers)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.alone_diagnosis",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny checkpoint")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), metavar="L,L,...",
                        help="the forwards' token counts (default %(default)s)")
    args = parser.parse_args(argv)
    lengths = tuple(int(n) for n in args.lengths.split(","))
    report = {"device": str(mx.default_device()), "switch_rows": switch_splits(),
              "forward_tokens": forwards(args.quick, lengths)}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
