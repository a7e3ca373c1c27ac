"""The `shoal` command: one subcommand per user task, each a thin shell over library calls.

Expected failures (ShoalError) are printed as one line without a traceback, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from engine.auth import create_secret, load_secret, secret_path
from engine.errors import ShoalError


def cmd_cluster_init(args: argparse.Namespace) -> None:
    path = create_secret(secret_path(args.secret_file), force=args.force)
    print(f"wrote a new cluster secret to {path} (mode 0600)")
    print("copy it to the same path on every Mac of the cluster, for example:")
    print(f"  scp -p {path} other-mac.local:{path}")


def cmd_shard(args: argparse.Namespace) -> None:
    from engine.checkpoint import shard

    manifest = shard(
        args.model_dir,
        args.out_dir,
        workers=args.workers,
        quantize_bits=args.quantize,
        group_size=args.group_size,
        progress=not args.quiet,
    )
    total = sum(e.bytes for e in manifest.experts)
    print(
        f"sharded {manifest.model_type}: {len(manifest.experts)} experts in "
        f"{len(manifest.layers)} MoE layers ({total / 2**20:.1f} MiB), model "
        f"{manifest.fingerprint[:12]} -> {args.out_dir}"
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from coordinator.cluster import parse_addresses
    from coordinator.generate import encode_prompt, generate, open_remote_model, stats_report

    addresses = parse_addresses(args.workers)
    secret = load_secret(secret_path(args.secret_file))
    remote = open_remote_model(args.model, addresses, secret)
    try:
        prompt_ids = encode_prompt(remote.tokenizer, args.prompt, chat=args.chat)

        def stream(text: str) -> None:
            print(text, end="", flush=True)

        result = generate(
            remote.model, remote.tokenizer, prompt_ids,
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
            on_text=None if args.json else stream,
        )
    finally:
        remote.close()
    report = {
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "prefill_tps": result.prefill_tps,
        "decode_tps": result.decode_tps,
        "finish_reason": result.finish_reason,
    }
    if args.stats:
        report["stats"] = stats_report(remote.dispatcher.stats, result)
    if args.json:
        print(json.dumps(report))
        return
    print()
    print(
        f"prefill {len(prompt_ids)} tokens at {result.prefill_tps:.1f} tok/s, "
        f"decode {len(result.token_ids)} tokens at {result.decode_tps:.1f} tok/s",
        file=sys.stderr,
    )
    if args.stats:
        print_stats(report["stats"])


def print_stats(stats: dict) -> None:
    out = sys.stderr
    print("per layer (all calls):", file=out)
    print(f"  {'layer':>5} {'calls':>6} {'ms/call':>8} {'worker ms':>9} {'sent':>10} {'recv':>10}",
          file=out)
    for layer, s in stats["layers"].items():
        print(
            f"  {layer:>5} {s['calls']:>6} {s['ms_per_call']:>8.2f} "
            f"{s['worker_compute_ms_per_call']:>9.2f} {s['bytes_sent']:>10} "
            f"{s['bytes_received']:>10}",
            file=out,
        )
    ms = stats["token_ms"]
    print(f"per token ms: first {ms[0]:.1f} (includes prefill), then "
          + " ".join(f"{t:.1f}" for t in ms[1:20]) + (" ..." if len(ms) > 20 else ""), file=out)
    print(f"bytes per token: sent {stats['bytes_sent_per_token']:.0f}, "
          f"received {stats['bytes_received_per_token']:.0f}", file=out)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description=(
            "Run a Mixture-of-Experts model whose routed experts are spread over several "
            "machines. Typical use: `shoal cluster-init`, `shoal shard MODEL OUT --workers N`, "
            "start `shoal-worker --store OUT/worker-K` on each machine, then `shoal generate`."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def secret_option(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--secret-file", metavar="PATH",
            help="cluster secret (default: $SHOAL_SECRET_FILE, else ~/.config/shoal/secret)",
        )

    p = sub.add_parser(
        "cluster-init", help="create the cluster secret shared by the coordinator and workers",
        description="Create a random cluster secret (mode 0600). Copy the file to the same path "
        "on every machine; workers refuse calls that do not prove they hold it.",
    )
    secret_option(p)
    p.add_argument("--force", action="store_true", help="replace an existing secret")
    p.set_defaults(func=cmd_cluster_init)

    p = sub.add_parser(
        "shard", help="split a MoE checkpoint into dense weights and one file per expert",
        description="Read a local mlx-lm MoE checkpoint (Hugging Face per-expert layout or "
        "mlx-lm's stacked/quantized layout) and write OUT_DIR/dense, one file per (layer, "
        "expert) with a checksummed manifest, and store folders for the workers.",
    )
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    p.add_argument("--workers", type=int, metavar="N",
                   help="write N store folders OUT_DIR/worker-K balanced by bytes "
                   "(default: one folder OUT_DIR/experts)")
    p.add_argument("--quantize", type=int, metavar="BITS", help="quantize with mlx-lm first")
    p.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="quantization group size (default 64)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_shard)

    p = sub.add_parser(
        "generate", help="generate text with the experts served by running workers",
        description="Load the dense part of a sharded model, connect to the workers, and "
        "generate with mlx-lm's sampling and KV cache. Greedy by default; the prompt is used "
        "as given unless --chat applies the chat template.",
    )
    p.add_argument("prompt", metavar="PROMPT")
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--workers", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the running shoal-worker daemons")
    p.add_argument("--max-tokens", type=int, default=100, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--stats", action="store_true",
                   help="also report per-token and per-layer timing and bytes sent")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    secret_option(p)
    p.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> None:
    # Everything Shoal reads is local; never let a library reach for a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ShoalError as e:
        print(f"shoal: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nshoal: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
