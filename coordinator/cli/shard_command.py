"""`shoal shard`: split a checkpoint into dense weights and one file per expert."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from coordinator.cli.options import AddParser
from coordinator.ops.hub import local_model
from engine.errors import InvalidInput
from engine.heat import check_heat_matches


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
                   "(default: one folder OUT_DIR/experts; with --member, one per member)")
    p.add_argument("--member", action="append", metavar="NAME=MEMORY:READ",
                   help="a member for worker-K (K in the order given, repeat): its memory "
                   "budget for experts and its drive's read speed, e.g. a=24G:40MB/s (MB/s, "
                   "GB/s decimal; MiB/s binary). When the experts outgrow the members' "
                   "memory they are placed for streaming: each member's hot set fits its "
                   "budget and the cold reads go to members in proportion to their drive "
                   "speed. Start each worker with that --memory-budget")
    p.add_argument("--cluster-config", type=Path, metavar="FILE",
                   help="the members from a cluster config instead (cluster-configs/*.toml): "
                   "each [[workers]] table with memory_budget = \"24G\" and read_speed = "
                   "\"40MB/s\", worker-K for the K-th")
    p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                   help="share of each member's memory budget the plan leaves free, as "
                   "`shoal rebalance --spare` does (default 10)")
    p.add_argument("--drive-copies", type=int, default=1, metavar="N",
                   help="with streamed placement, each cold expert (one not in memory) on N "
                   "members' drives, each miss read from the copy whose drive ends soonest; "
                   "N times the cold experts' disk (default 1; docs/streaming.md: when it pays)")
    p.add_argument("--heat", type=Path, metavar="FILE",
                   help="place by this heat (with --member or --cluster-config): `shoal heat "
                   "--json`'s output or a cluster's heat.msgpack (default: OUT_DIR/heat.msgpack "
                   "of the split --force replaces, if any; else every expert alike)")
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
    from coordinator.ops.planning import member_lines, placement_members, shard_heat
    from engine.moe_layers import resolve_model_dir
    from engine.placement import store_placement
    from engine.sharding import shard
    from engine.sizes import top_k_of

    source = local_model(args.model_dir)
    members = placement_members(args.member, args.cluster_config)
    workers, place, heat = args.workers, None, None
    if members:
        if workers is not None and workers != len(members):
            raise InvalidInput(f"--workers {workers} but {len(members)} members: give one")
        workers = len(members)
        heat = shard_heat(args.heat, args.out_dir)
        config = json.loads((resolve_model_dir(source) / "config.json").read_text())
        top_k = top_k_of(config)

        def place(sizes):
            if heat is not None:
                check_heat_matches(heat, sizes)
            return store_placement(members, sizes, heat, top_k=top_k, spare=args.spare / 100,
                                   drive_copies=args.drive_copies)

    manifest = shard(
        source,
        args.out_dir,
        workers=workers,
        quantize_bits=args.quantize,
        group_size=args.group_size,
        progress=not args.quiet,
        force=args.force,
        place=place,
    )
    total = sum(e.bytes for e in manifest.experts)
    print(
        f"sharded {manifest.model_type}: {len(manifest.experts)} experts in "
        f"{len(manifest.layers)} MoE layers ({total / 2**20:.1f} MiB), model "
        f"{manifest.fingerprint[:12]} -> {args.out_dir}"
    )
    if members:
        spare = args.spare / 100
        print("\n".join(member_lines(members, manifest, args.out_dir, heat, spare)))
    else:
        print(next_step(args.out_dir, args.workers))


def next_step(out: Path, workers: int | None) -> str:
    """What to run with the split just written, as `shoal demo` ends with its next commands."""
    model = shlex.quote(str(out))
    if not workers:
        return (f"next: shoal generate --model {model} --local-store "
                f"{shlex.quote(str(out / 'experts'))} --chat \"Hello\" (this machine "
                "serves every expert itself; `shoal serve` takes the same options)")
    stores = shlex.quote(str(out / "worker-K"))
    return (f"next: on each machine K (0-{workers - 1}), with its folder {stores} copied "
            f"there: shoal-worker --store {stores}; then here: shoal generate --model {model} "
            "--chat \"Hello\" (finds the workers with Bonjour; or --workers HOST:PORT,...)")
