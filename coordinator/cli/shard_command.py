"""`shoal shard`: split a checkpoint into dense weights and one file per expert."""

from __future__ import annotations

import argparse
from pathlib import Path

from coordinator.cli.options import AddParser
from coordinator.ops.hub import local_model


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "shard", help="split a MoE checkpoint into dense weights and one file per expert",
        description="Read a local mlx-lm MoE checkpoint (Hugging Face per-expert layout or "
        "mlx-lm's stacked/quantized layout) and write OUT_DIR/dense, one file per (layer, "
        "expert) with a checksummed manifest, and store folders for the workers.",
    )
    p.add_argument("model_dir", metavar="MODEL",
                   help="the source checkpoint: a folder with config.json and "
                   "model*.safetensors (Hugging Face or mlx-community), a Hugging Face "
                   "cache entry such as ~/.cache/huggingface/hub/models--ORG--NAME, or a "
                   "repository id ORG/NAME already in that cache (`shoal pull ORG/NAME` "
                   "downloads it)")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR",
                   help="where to write the split: an empty folder, on any drive (it need "
                   "not be the source's); about the size of the source, or of its quantized "
                   "form with --quantize (`shoal plan` tells). An interrupted split is "
                   "finished by running the same command again; a finished one is refused "
                   "unless --force")
    p.add_argument("--workers", type=int, metavar="N",
                   help="write N store folders OUT_DIR/worker-K balanced by bytes "
                   "(default: one folder OUT_DIR/experts)")
    p.add_argument("--quantize", type=int, metavar="BITS",
                   help="quantize with mlx-lm first (2, 3, 4, 5, 6 or 8 bits; affine, as "
                   "mlx_lm.convert -q does)")
    p.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="quantization group size (default 64)")
    p.add_argument("--force", action="store_true",
                   help="replace an earlier split in OUT_DIR: its store folders, dense part, "
                   "manifest, recorded heat and unfinished rebalance are removed first. Never "
                   "done to a store a running shoal-worker serves, nor to a folder `shoal "
                   "shard` did not write")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(main=main)


def main(args: argparse.Namespace) -> None:
    # lazy: start-up
    from engine.sharding import shard

    manifest = shard(
        local_model(args.model_dir),
        args.out_dir,
        workers=args.workers,
        quantize_bits=args.quantize,
        group_size=args.group_size,
        progress=not args.quiet,
        force=args.force,
    )
    total = sum(e.bytes for e in manifest.experts)
    print(
        f"sharded {manifest.model_type}: {len(manifest.experts)} experts in "
        f"{len(manifest.layers)} MoE layers ({total / 2**20:.1f} MiB), model "
        f"{manifest.fingerprint[:12]} -> {args.out_dir}"
    )
