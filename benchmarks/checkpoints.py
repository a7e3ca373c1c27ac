"""The bench's checkpoint (a DeepSeek-V3-shaped MoE from builders/synthetic.py), its worker
stores, secret and log folder: built once into Shoal's cache and shared by every benchmark."""

from __future__ import annotations

import sys
from pathlib import Path

from builders.demo_models import build_once, cache_root
from builders.synthetic import build_checkpoint
from engine.auth import ensure_secret
from engine.sharding import shard

# runs: generations at the shortest prompt (the decode figure); long_runs: at each longer one
FULL = {"size": "bench", "bits": 4, "group_size": 64, "lengths": [16, 128, 512, 4096],
        "decode_tokens": 32, "runs": 3, "long_runs": 1, "echo_round_trips": 300}
# float32: the tiny model's 4-bit scales are too narrow for mlx-lm's tensor-parallel split.
QUICK = {"size": "tiny", "bits": None, "group_size": 32, "lengths": [16, 64], "decode_tokens": 8,
         "runs": 1, "long_runs": 1, "echo_round_trips": 50}
WORKERS = 2


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)

FAMILY = "deepseek_v3"  # the bench's; `settings["family"]` names another, built beside it


def prepare(settings: dict, root: Path) -> tuple[Path, Path]:
    family = settings.get("family", FAMILY)
    root = root if family == FAMILY else root / family
    source = build_once(
        root / "source",
        lambda out: build_checkpoint(out, family, size=settings["size"],
                                     quantize_bits=settings["bits"],
                                     group_size=settings["group_size"]),
        f"the {settings['size']} {family} checkpoint",
    )
    sharded = build_once(root / f"sharded-w{WORKERS}",
                         lambda out: shard(source, out, workers=WORKERS, progress=False),
                         f"{WORKERS} worker stores")
    return source, sharded

def bench_root(quick: bool) -> Path:
    return cache_root() / "bench" / ("quick" if quick else "full")

def bench_checkpoint(quick: bool, settings: dict | None = None) -> tuple[Path, Path]:
    """The bench's checkpoint (with `quick` the tiny one) and its worker stores, built once
    under Shoal's cache; `settings` in place of the preset's (its size, bits, group size)."""
    return prepare(settings or (QUICK if quick else FULL), bench_root(quick))

def bench_files(quick: bool, logs: str = "logs",
                settings: dict | None = None) -> tuple[Path, Path, Path, Path]:
    """What a run of the bench's cluster needs: `bench_checkpoint`'s two, the cluster's secret
    file, and a folder for the workers' logs."""
    source, sharded = bench_checkpoint(quick, settings)
    secret_file = bench_root(quick) / "secret"
    ensure_secret(secret_file)
    log_dir = bench_root(quick) / logs
    log_dir.mkdir(parents=True, exist_ok=True)
    return source, sharded, secret_file, log_dir
