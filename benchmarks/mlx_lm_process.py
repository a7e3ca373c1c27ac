"""mlx-lm alone in a process of its own (optionally inside a member's cgroup limits): the
reference every streaming benchmark compares its greedy ids and speed with."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.stream_limits import MemberLimits

MLX_LM_SCRIPT = """
import json, sys, time
import mlx.core as mx
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
started = time.perf_counter()
model, tokenizer = load(sys.argv[1])
loaded = time.perf_counter() - started
ids = json.loads(sys.argv[2])
out, last = [], None
for r in stream_generate(model, tokenizer, mx.array(ids), max_tokens=int(sys.argv[3]),
                         sampler=make_sampler(temp=0.0)):
    out.append(int(r.token)); last = r
import resource, platform
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": out, "decode_tps": last.generation_tps, "load_s": loaded,
                  "peak_memory": mx.get_peak_memory(),
                  "peak_rss": rss if platform.system() == "Darwin" else rss * 1024}))
"""


def run_mlx_lm(model_dir: Path, ids: list[int], tokens: int, limit: MemberLimits | None) -> dict:
    """mlx-lm's greedy generation of `tokens` from `ids`: its ids, decode speed, peak memory;
    {"error": ...} where it failed (killed by the memory limit, say)."""
    cmd = [sys.executable, "-c", MLX_LM_SCRIPT, str(model_dir), json.dumps(ids), str(tokens)]
    if limit is not None:
        cmd = limit.wrap(cmd)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        killed = proc.returncode in (-9, 137)
        return {"error": "killed (out of memory)" if killed else proc.stderr.strip()[-300:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])
