"""The options several commands share: the workers (--workers, --cluster, --cluster-config,
--interface, --wait), the coordinator's own experts (--local-store, --memory-budget), the secret
(--secret-file), mlx-lm's KV-cache bits (--kv-bits) and the draft (--draft, --draft-model)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.decoding.draft_policy import DEFAULT_DRAFT_TOKENS, DraftPolicy
from engine.auth import load_secret, secret_path
from engine.errors import InvalidInput
from engine.manifest import not_written_by_shard

if TYPE_CHECKING:
    from coordinator.decoding.generate import RemoteModel
    from coordinator.decoding.mtp_draft import MtpDraft
    from coordinator.decoding.speculative import Draft

# How long to listen for Bonjour answers at least. A responder that multicast an answer in the
# last second (to another browser: every worker runs one) sends it again only after a second
# and an aggregation delay of up to 0.5 s (RFC 6762 section 14), so 1.5 s can miss a worker.
BROWSE_SECONDS = 2.5

# What a command's setup_arg_parser is given: the `add_parser` of shoal's subcommands.
AddParser = Callable[..., argparse.ArgumentParser]


def discovery_options(p: argparse.ArgumentParser, *, wait: float, wait_help: str) -> None:
    p.add_argument("--cluster", metavar="NAME",
                   help="the cluster name the workers announce (default 'default')")
    p.add_argument("--cluster-config", type=Path, metavar="FILE",
                   help="a cluster described by hand (cluster-configs/*.toml) instead of "
                   "Bonjour; for networks where multicast does not get through")
    p.add_argument("--interface", metavar="NAME",
                   help="reach workers through this interface of ours (e.g. bridge0, en0) "
                   "when they have an address on it; default: Thunderbolt Bridge, then "
                   "wired, then wireless")
    p.add_argument("--wait", type=float, default=wait, metavar="SECONDS", help=wait_help)


def secret_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file", metavar="PATH",
        help="cluster secret (default: $SHOAL_SECRET_FILE, else ~/.config/shoal/secret)",
    )


def live_options(p: argparse.ArgumentParser) -> None:
    """--model and the live workers to ask, for the commands that read or change what the
    running workers hold (`shoal heat`, `deploy`, `rebalance`)."""
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the workers (default: those of --cluster found on "
                   "the local network)")
    discovery_options(p, wait=4.0, wait_help="how long to look for workers (default 4)")
    local_store_options(p)
    secret_option(p)


def cluster_secret(args: argparse.Namespace) -> bytes:
    """The secret --secret-file names (or the default one); refused when missing or when
    others may read it."""
    return load_secret(secret_path(args.secret_file))


def check_one_worker_source(args: argparse.Namespace) -> None:
    """Workers come from --workers, or from --cluster / --cluster-config: never both."""
    if args.workers and (args.cluster_config or args.cluster):
        raise InvalidInput("give --workers, or --cluster / --cluster-config, not both")


def browse_seconds(args: argparse.Namespace, *, static: bool = False) -> float:
    """How long to listen for Bonjour answers at least: not at all for listed workers."""
    if static or args.cluster_config:
        return 0.0
    return BROWSE_SECONDS if args.wait is None else min(args.wait, BROWSE_SECONDS)


def transport_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=["lane", "grpc"], default="lane",
                   help="how each MoE layer's requests travel to the workers: lane (default) on "
                   "each worker's expert lane, a bare TLS socket; grpc on the gRPC Compute "
                   "stream, slower, for networks where the lane's port cannot pass "
                   "(docs/protocol.md)")
    p.add_argument("--spin-us", type=float, default=0.0, metavar="US",
                   help="microseconds an expert lane watches its socket busily for a reply "
                   "before it sleeps (default 0: it sleeps at once; spinning burns a core to "
                   "save a wake-up, see docs/benchmarks.md)")


def transport_of(args: argparse.Namespace):
    """--transport and --spin-us as a coordinator.dataplane.link.Transport."""
    # lazy: start-up
    from coordinator.dataplane.link import Transport

    return Transport(args.transport, args.spin_us / 1e6)


def local_store_options(p: argparse.ArgumentParser) -> None:
    """--local-store and --memory-budget: experts this machine serves in the coordinator's own
    process (coordinator/dataplane/local_experts.py), in shoal-worker's forms."""
    p.add_argument("--local-store", action="append", type=Path, metavar="DIR",
                   help="a store folder on this machine (written by `shoal shard`) whose experts "
                   "the coordinator serves itself, in its own process, with the code a "
                   "worker runs and no network hop (repeat for one folder per drive); with "
                   "every expert here and no --workers or --cluster, no worker is needed")
    p.add_argument("--memory-budget", metavar="SIZE",
                   help="memory for the --local-store experts, as for shoal-worker: 512M, "
                   "24G, or 25%% of their bytes; the rest stay on the drives and are read "
                   "when routed (default: 60%% of physical memory)")


def check_local_store_args(args: argparse.Namespace) -> None:
    """--memory-budget goes with --local-store and is one of the worker's forms."""
    # lazy: start-up
    from engine.cache_policy import parse_budget

    if args.memory_budget is not None:
        if not args.local_store and not args.cluster_config:
            raise InvalidInput("--memory-budget is for the coordinator's own experts: give "
                               "--local-store DIR too")
        parse_budget(args.memory_budget)
    for store in args.local_store or ():
        if problem := not_written_by_shard(store):
            raise InvalidInput(f"--local-store: {problem}")


def model_options(p: argparse.ArgumentParser, *, wait: float,
                  workers_help: str = "addresses of the running shoal-worker daemons "
                  "(default: find the workers of --cluster on the local network with Bonjour)"
                  ) -> None:
    """--model and where its experts are (--workers, the cluster, --transport, --local-store):
    every command that loads the model to run it (connect.remote_model reads them)."""
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]", help=workers_help)
    discovery_options(p, wait=wait, wait_help="how long to wait for workers to hold every "
                      f"expert (default {wait:g})")
    transport_options(p)
    local_store_options(p)


def check_model_args(args: argparse.Namespace) -> None:
    """model_options' arguments, refused before anything loads."""
    if args.wait < 0:
        raise InvalidInput(f"--wait must be 0 or more seconds, got {args.wait:g}")
    check_one_worker_source(args)
    check_local_store_args(args)
    check_model_folder(Path(args.model))


def check_model_folder(model: Path) -> None:
    """--model names the folder `shoal shard` wrote, not one of its stores or a folder above."""
    if (model / "manifest.json").exists() and not (model / "dense").is_dir() and (
            model.parent / "dense").is_dir():
        raise InvalidInput(f"--model {model} is a worker's store folder (for shoal-worker "
                           f"--store, or --local-store); --model takes the folder `shoal "
                           f"shard` wrote, with the dense part: --model {model.parent}")
    if not model.exists():
        raise InvalidInput(f"--model {model} does not exist")
    if not (model / "manifest.json").exists():
        below = sorted(p.parent for p in model.glob("*/dense/config.json"))
        hint = f"; did you mean --model {below[0].parent}?" if below else ""
        raise InvalidInput(f"--model {model} is not a folder written by `shoal shard` "
                           f"(it has no manifest.json){hint}")


def kv_cache_options(p: argparse.ArgumentParser) -> None:
    """--kv-bits, --kv-group-size, --quantized-kv-start: mlx-lm's KV-cache quantization."""
    p.add_argument("--kv-bits", type=int, choices=[2, 3, 4, 6, 8], metavar="BITS",
                   help="quantize the KV cache to BITS bits, as mlx-lm does (default: not "
                   "quantized); less memory for long contexts, slightly different answers")
    p.add_argument("--kv-group-size", type=int, default=64, choices=[32, 64, 128],
                   metavar="N", help="quantization group size of the KV cache (default 64)")
    p.add_argument("--quantized-kv-start", type=int, default=5000, metavar="TOKENS",
                   help="with --kv-bits, quantize once the cache holds this many tokens "
                   "(default 5000, mlx-lm's)")


def kv_cache_settings(args: argparse.Namespace) -> dict:
    """The KV-cache options as mlx-lm's generate_step takes them (none without --kv-bits)."""
    if args.quantized_kv_start < 0:
        raise InvalidInput(f"--quantized-kv-start must be 0 or more, got "
                           f"{args.quantized_kv_start}")
    if args.kv_bits is None:
        return {}
    return {"kv_bits": args.kv_bits, "kv_group_size": args.kv_group_size,
            "quantized_kv_start": args.quantized_kv_start}


def draft_options(p: argparse.ArgumentParser) -> None:
    """--draft mtp, --draft-model, --num-draft-tokens and --fixed-draft: speculative decoding."""
    drafts = p.add_mutually_exclusive_group()
    drafts.add_argument("--draft", choices=["mtp"],
                        help="speculative decoding with the model's own multi-token-prediction "
                        "module (DeepSeek-V3 and its family, GLM-4.5 MoE), run here with its "
                        "experts on the workers: no second model (docs/speculative.md)")
    drafts.add_argument("--draft-model", type=Path, metavar="PATH",
                        help="speculative decoding: a small mlx-lm model with the same "
                        "tokenizer, run here, proposes tokens that the sharded model checks "
                        "several at a time (same greedy output, fewer round trips; "
                        "docs/speculative.md)")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help=f"most tokens the draft proposes per step (default "
                   f"{DEFAULT_DRAFT_TOKENS}); fewer, or none, while it is seldom accepted")
    p.add_argument("--fixed-draft", action="store_true",
                   help="always propose N tokens, however few are accepted")


def draft_policy(args: argparse.Namespace) -> DraftPolicy | None:
    """The drafting policy that --draft or --draft-model and friends ask for, or None without
    a draft."""
    if not drafting(args):
        if args.num_draft_tokens is not None or args.fixed_draft:
            raise InvalidInput("--num-draft-tokens and --fixed-draft need --draft or "
                               "--draft-model")
        return None
    if args.draft_model is not None and not args.draft_model.is_dir():
        raise InvalidInput(f"--draft-model {args.draft_model} is not a model folder")
    n = DEFAULT_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    return DraftPolicy(max_draft=n, adaptive=not args.fixed_draft)


def drafting(args: argparse.Namespace) -> bool:
    return args.draft is not None or args.draft_model is not None


def load_draft_of(args: argparse.Namespace, remote: RemoteModel,
                  policy: DraftPolicy) -> Draft | MtpDraft:
    """The draft the options name: the model's own MTP module, or a draft model."""
    if args.draft == "mtp":
        # lazy: start-up
        from coordinator.decoding.mtp_draft import mtp_draft

        return mtp_draft(remote.model, policy)
    # lazy: start-up
    from coordinator.decoding.speculative import load_draft

    return load_draft(args.draft_model, remote.tokenizer, policy)
