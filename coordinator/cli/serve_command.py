"""`shoal serve`: the OpenAI API over a sharded model (coordinator/server/: the HTTP server is
http_server.py, the API's request and answer shapes openai_api.py, the batched decoding
batching.py)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.connect import (
    local_stores,
    needs_workers,
    open_membership,
    record_run_heat,
)
from coordinator.cli.options import (
    AddParser,
    browse_seconds,
    check_local_store_args,
    check_one_worker_source,
    cluster_secret,
    discovery_options,
    draft_options,
    draft_policy,
    load_draft_of,
    local_store_options,
    secret_option,
    transport_options,
)
from coordinator.server.prefill_pacing import BUDGET_STEPS
from engine.errors import InvalidInput
from engine.manifest import read_manifest
from engine.process import raise_file_limit

if TYPE_CHECKING:
    from coordinator.cluster.snapshot import Cluster
    from coordinator.server.http_limits import Limits
    from coordinator.server.prompt_cache_tiers import DiskTier


# Without --wait: the most seconds the workers found at start may take to answer (a dead
# one: until it counts as unreachable) before the server answers, so that a healthy cluster's
# first request is served rather than refused.
FIRST_ANSWERS = 5.0


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "serve", help="serve the model over the OpenAI API (chat and text completions)",
        description="Load the dense part of a sharded model, connect to the workers, and "
        "answer the OpenAI API (POST /v1/chat/completions and /v1/completions, streamed or "
        "not, with tools and structured output; POST /v1/responses; GET /v1/models and /health), "
        "Anthropic's "
        "Messages API (POST /v1/messages) and Ollama's (/api/chat, /api/generate, /api/tags), "
        "with a dashboard of the cluster at GET / and Prometheus metrics at GET /metrics. "
        "Requests in flight are decoded together, so each "
        "MoE layer costs one round trip per worker for all of them; a multi-turn chat reuses "
        "the KV cache of its earlier turns, kept in memory and on disk across restarts, and "
        "a long prompt is computed in pieces between decode steps. With --draft mtp or "
        "--draft-model, a request decoding alone goes through speculative decoding (same "
        "output, fewer round trips). Listens on loopback "
        "unless --host says otherwise; see docs/serving.md.",
    )
    p.add_argument("--model", type=Path, required=True, metavar="OUT_DIR",
                   help="the folder written by `shoal shard`")
    p.add_argument("--workers", metavar="HOST:PORT[,HOST:PORT...]",
                   help="addresses of the running shoal-worker daemons, watched and taken "
                   "back in when they restart (default: find the workers of --cluster on the "
                   "local network with Bonjour)")
    discovery_options(p, wait=None, wait_help="wait at most this long at start for the workers "
                      "to hold every expert, then exit with status 2 (default: start at once, "
                      "answer model requests with 503 naming what is missing until they do, "
                      "and keep looking)")
    transport_options(p)
    local_store_options(p)
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
    p.add_argument("--prompt-cache-disk", default="10G", metavar="SIZE",
                   help="disk for the same KV caches, kept across restarts and read back when "
                   "a prompt shares a prefix of at least 256 tokens with one (default 10G; 0: "
                   "none)")
    p.add_argument("--prompt-cache-dir", type=Path, metavar="PATH",
                   help="where those files go (default: prompt-cache/ in $SHOAL_CACHE, else "
                   "~/.cache/shoal)")
    p.add_argument("--prefill-step", type=int, default=256, metavar="TOKENS",
                   help="the most prompt tokens the model computes in one pass (default "
                   "256); beside running streams a prompt goes in pieces sized by time, about "
                   "two of their decode steps each, so their streams keep flowing")
    p.add_argument("--prefill-budget", type=float, default=BUDGET_STEPS, metavar="STEPS",
                   help="what one piece of a prompt may cost beside running streams, in their "
                   f"decode steps (default {BUDGET_STEPS:g}): smaller keeps their tokens "
                   "flowing more evenly, larger brings the new prompt's first token sooner")
    p.add_argument("--context", type=int, metavar="TOKENS",
                   help="prompt and answer together at most (default: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-body", default="4M", metavar="SIZE",
                   help="the largest request body taken; larger ones get 413 (default 4M)")
    p.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="connections open at once from all clients; when full, the one idle "
                   "longest is closed for a new one (default 1024, and at most half the "
                   "process's file limit)")
    p.add_argument("--max-connections-per-host", type=int, default=64, metavar="N",
                   help="connections open at once from one address; more get 503 (default "
                   "64; raise it behind a reverse proxy, where every client has its address)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let browser pages from ORIGIN (e.g. http://localhost:3000; '*' for "
                   "any) call the API (repeat for several; default: none)")
    p.add_argument("--drain-seconds", type=float, default=5.0, metavar="S",
                   help="on SIGTERM or SIGINT, refuse new requests and give the answers in "
                   "flight up to S seconds to finish before they are ended (default 5; a "
                   "second signal ends them at once)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"],
                   help="what the server logs to stderr: info (the default) logs a line per "
                   "request; warning and up only problems")
    draft_options(p)
    secret_option(p)
    p.set_defaults(main=main)


def check_serve_args(args: argparse.Namespace) -> int:
    """Refuse what cannot work before anything is read, bound or loaded; return the prompt
    cache's size in bytes (--prompt-cache-bytes, parsed once here)."""
    # lazy: start-up
    from engine.cache_policy import parse_budget

    for name in ("max_connections", "max_connections_per_host"):
        if getattr(args, name) < 1:
            raise InvalidInput(f"--{name.replace('_', '-')} must be at least 1, got "
                               f"{getattr(args, name)}")

    if args.wait is not None and not args.wait >= 0:
        raise InvalidInput(f"--wait takes seconds, 0 or more, got {args.wait:g}")
    if not 0 <= args.drain_seconds <= 3600:
        raise InvalidInput(f"--drain-seconds must be 0-3600, got {args.drain_seconds:g}")
    check_one_worker_source(args)
    check_local_store_args(args)
    if not 0 <= args.port < 65536:
        raise InvalidInput(f"--port must be between 0 and 65535, got {args.port}")
    if args.context is not None and args.context < 2:
        raise InvalidInput(f"--context must be at least 2 tokens, got {args.context}")
    if args.max_batch < 1:
        raise InvalidInput(f"--max-batch must be at least 1, got {args.max_batch}")
    if args.prefill_step < 1:
        raise InvalidInput(f"--prefill-step must be at least 1, got {args.prefill_step}")
    if not args.prefill_budget > 0:
        raise InvalidInput(f"--prefill-budget must be above 0, got {args.prefill_budget:g}")
    cache_bytes = parse_budget(args.prompt_cache_bytes).bytes
    if cache_bytes is None:
        raise InvalidInput("--prompt-cache-bytes takes a size such as 512M or 2G")
    disk = parse_budget(args.prompt_cache_disk).bytes if args.prompt_cache_disk != "0" else 0
    if disk is None:
        raise InvalidInput("--prompt-cache-disk takes a size such as 10G, or 0 for none")
    args.prompt_cache_disk_bytes = disk
    return cache_bytes


def serve_limits(args: argparse.Namespace, file_limit: int) -> Limits:
    """What one client may hold (--max-body, --max-connections...), with the connections kept
    to half the process's `file_limit`: the rest is for the worker links and model files."""
    # lazy: start-up
    from coordinator.server.http_limits import Limits
    from engine.cache_policy import parse_budget

    try:
        body = parse_budget(args.max_body).bytes
    except InvalidInput:
        body = None
    if body is None or body < 1024:
        raise InvalidInput(f"--max-body takes a size of at least 1K such as 4M, got "
                           f"{args.max_body!r}")
    connections = args.max_connections
    if file_limit and connections > file_limit // 2:
        connections = max(file_limit // 2, 1)
        print(f"shoal serve: at most {connections} connections (--max-connections "
              f"{args.max_connections}): this process may open {file_limit} files",
              file=sys.stderr)
    return Limits(max_body=body, max_connections=connections,
                  max_connections_per_host=min(args.max_connections_per_host, connections))


def prompt_cache_disk(args: argparse.Namespace, model, manifest) -> DiskTier | None:
    """The prompt cache's disk tier: this model's folder under --prompt-cache-dir."""
    from mlx_lm.models.cache import make_prompt_cache

    # lazy: start-up
    from builders.demo_models import cache_root
    from coordinator.server.prompt_cache_tiers import DiskTier

    if not args.prompt_cache_disk_bytes:
        return None
    root = args.prompt_cache_dir or cache_root() / "prompt-cache"
    try:
        return DiskTier(root / manifest.fingerprint[:32], manifest.fingerprint,
                        args.prompt_cache_disk_bytes, len(make_prompt_cache(model)))
    except OSError as e:
        raise InvalidInput(f"--prompt-cache-dir {root}: {e.strerror}") from None


def plain_log_names(record: logging.LogRecord) -> bool:
    """uvicorn logs its start and stop as "uvicorn.error", which reads as an error: "uvicorn"."""
    if record.name == "uvicorn.error":
        record.name = "uvicorn"
    return True


def say_when_served(cluster: Cluster, workers: str) -> None:
    """Say at start whether `workers` hold every expert, and again whenever that changes: until
    they do, model requests get 503 naming what is missing."""
    waiting = "answering 503 until they hold every expert (--wait SECONDS exits instead)"
    said = [not cluster.current.missing]
    print("shoal serve: every expert has a live owner" if said[0] else
          f"shoal serve: waiting for {workers}: {waiting}", file=sys.stderr, flush=True)

    def changed() -> None:  # after the cluster's own watcher: `current` is the new snapshot
        served = not cluster.current.missing
        if served != said[0]:
            said[0] = served
            print("shoal serve: every expert has a live owner now: serving" if served
                  else f"shoal serve: not every expert has a live owner: {waiting}",
                  file=sys.stderr, flush=True)

    cluster.members.watch(changed)
    changed()  # a change between the first line and the watch above is said too


def main(args: argparse.Namespace) -> None:
    """Validate everything, bind, load, then answer until interrupted."""
    # lazy: start-up
    from coordinator.cluster.membership import stderr_log
    from coordinator.dataplane.merged_calls import MergedCalls
    from coordinator.decoding.generate import open_remote_model
    from coordinator.server.answering import Service
    from coordinator.server.batching import BatchEngine
    from coordinator.server.dashboard import Dashboard
    from coordinator.server.drafting import Drafting
    from coordinator.server.http_server import listen, read_api_key, serve

    policy = draft_policy(args)  # the draft options, checked before anything loads
    cache_bytes = check_serve_args(args)
    limits = serve_limits(args, raise_file_limit())  # after mlx-lm's import, which sets one
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="shoal serve: %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(plain_log_names)
    key = read_api_key(args.api_key_file) if args.api_key_file else None
    manifest = read_manifest(args.model)
    stores, memory_budget = local_stores(args)
    alone = not needs_workers(args, manifest, stores)  # one Mac: no workers, no secret
    secret = b"" if alone else cluster_secret(args)
    context = args.context or int(manifest.config.get("max_position_embeddings") or 4096)
    sock = listen(args.host, args.port)
    membership = None if alone else open_membership(args, secret, manifest, log=stderr_log)
    remote = engine = dashboard = None
    try:
        remote = open_remote_model(args.model, [], secret, membership=membership,
                                   wait=args.wait, on_wait=stderr_log, local_stores=stores,
                                   memory_budget=memory_budget)
        if membership is not None:
            if args.wait is None:  # found and answering while the model loaded, mostly
                membership.settle(FIRST_ANSWERS, at_least=browse_seconds(
                    args, static=bool(args.workers)))
            say_when_served(remote.cluster, membership.workers)
        drafting = None if policy is None else Drafting(
            remote.model, load_draft_of(args, remote, policy), remote.tokenizer.eos_token_ids)
        merged = remote.dispatcher.merged = MergedCalls()
        engine = BatchEngine(remote.model, remote.tokenizer, cache_key=manifest.fingerprint,
                             max_batch=args.max_batch, prompt_cache_bytes=cache_bytes,
                             prompt_cache_disk=prompt_cache_disk(args, remote.model, manifest),
                             prefill_step_size=args.prefill_step,
                             prefill_budget=args.prefill_budget, drafting=drafting,
                             merged=merged)
        name = args.model_id or Path(args.model).resolve().name
        # the members health reads: the workers, and the coordinator's own experts
        service = Service(engine, remote.tokenizer, manifest, remote.cluster.members, name,
                          context, key, started=int(time.time()), limits=limits,
                          cors_origins=tuple(args.cors_origin))
        dashboard = Dashboard(service, args.model, secret, remote.dispatcher)
        host, port = sock.getsockname()[:2]
        print(f"shoal serve: the dashboard is at http://{f'[{host}]' if ':' in host else host}"
              f":{port}/ (docs/dashboard.md)", file=sys.stderr, flush=True)
        serve(service, sock, log_level=args.log_level, mount=dashboard.routes,
              middleware=[dashboard.metrics.middleware()], drain=args.drain_seconds)
    finally:
        sock.close()
        if dashboard is not None:
            dashboard.close()
        if engine is not None:
            engine.close()
        if remote is not None:
            record_run_heat(args.model, remote.manifest, remote.cluster.members.live()[1])
            remote.close()
        if membership is not None:
            membership.close()
