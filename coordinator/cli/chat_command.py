"""`shoal chat`: a conversation with the sharded model in the terminal, like mlx-lm's chat
command (the conversation itself is coordinator/decoding/chat.py)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from coordinator.cli.connect import members_secret, remote_model
from coordinator.cli.options import (
    AddParser,
    check_model_args,
    kv_cache_options,
    kv_cache_settings,
    model_options,
    secret_option,
)
from coordinator.decoding.draft_policy import DEFAULT_DRAFT_TOKENS, DraftPolicy
from engine.errors import InvalidInput
from engine.manifest import read_manifest

if TYPE_CHECKING:
    from coordinator.decoding.mtp_draft import MtpDraft

HELP = ("/reset forgets the conversation, /quit (or Ctrl-D) ends it, Ctrl-C stops a reply, "
        '""" starts and ends a message of several lines, /help shows this')
MULTI_LINE = '"""'
COMMANDS = """shoal chat: type a message and press Enter; the reply streams, then its tokens/s.
  /help, /?          this list
  /reset             forget the conversation (and its KV cache) and start over
  /quit, /exit, /q   end the session (so does Ctrl-D on an empty line)
  Ctrl-C             stop the reply being written (the part written stays in the history);
                     at the prompt, clear the line
  \"\"\"                a line of three double quotes starts a message of several lines,
                     and another ends it
  Up / Down          earlier messages (line editing as in the shell: Ctrl-A, Ctrl-E, ...)"""


def setup_arg_parser(add_parser: AddParser) -> None:
    p = add_parser(
        "chat", help="chat with the model in the terminal (history, /reset, streaming)",
        description="Load the dense part of a sharded model, connect to the workers, and "
        "hold a conversation: each line you type is a message, the reply streams as it "
        "comes, then its tokens/s. The history goes through the chat template each turn, "
        "and the KV cache of earlier turns is kept, so a turn computes only its new "
        f"message. {HELP}.",
    )
    model_options(p, wait=30.0)
    p.add_argument("--system", metavar="TEXT", help="a system prompt for the conversation")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="at most N tokens a reply (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling (default 1: off)")
    p.add_argument("--seed", type=int, metavar="S", help="random seed for sampling")
    p.add_argument("--draft", choices=["mtp"],
                   help="speculative decoding with the model's own multi-token-prediction "
                   "module (DeepSeek-V3 family, GLM-4.5 MoE): the same replies, fewer round "
                   "trips (docs/speculative.md)")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="with --draft: most tokens proposed per step (default 3)")
    kv_cache_options(p)
    secret_option(p)
    p.set_defaults(main=main)


def check_chat_args(args: argparse.Namespace) -> None:
    if args.max_tokens < 1:
        raise InvalidInput(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.temperature < 0:
        raise InvalidInput(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise InvalidInput(f"--top-p must be above 0 and at most 1, got {args.top_p}")
    if kv_cache_settings(args) and args.draft:
        raise InvalidInput("--kv-bits and --draft cannot be used together")
    if args.num_draft_tokens is not None and not args.draft:
        raise InvalidInput("--num-draft-tokens needs --draft")
    if args.num_draft_tokens is not None:
        DraftPolicy(args.num_draft_tokens)  # checks N before the model loads
    check_model_args(args)


def chat_draft(args: argparse.Namespace, model) -> MtpDraft | None:
    """The MTP module drafting, when --draft mtp asks for it."""
    if not args.draft:
        return None
    # lazy: start-up
    from coordinator.decoding.mtp_draft import mtp_draft

    n = DEFAULT_DRAFT_TOKENS if args.num_draft_tokens is None else args.num_draft_tokens
    return mtp_draft(model, DraftPolicy(n))


def main(args: argparse.Namespace) -> None:
    import mlx.core as mx

    # lazy: start-up
    from coordinator.cluster.membership import stderr_log
    from coordinator.decoding.chat import Conversation

    check_chat_args(args)
    secret = members_secret(args, read_manifest(args.model))
    with remote_model(args, secret, stderr_log) as remote:
        if remote.tokenizer.chat_template is None:
            raise InvalidInput("this model's tokenizer has no chat template: use "
                               "`shoal generate` for plain text")
        if args.seed is not None:
            mx.random.seed(args.seed)
        conversation = Conversation(remote.model, remote.tokenizer, system=args.system,
                                    max_tokens=args.max_tokens,
                                    temperature=args.temperature, top_p=args.top_p,
                                    kv_cache=kv_cache_settings(args),
                                    draft=chat_draft(args, remote.model))
        print(f"shoal chat: {Path(args.model).resolve().name}; {HELP}", file=sys.stderr,
              flush=True)
        converse(conversation)


def converse(conversation) -> None:
    """The loop: a message in, a reply out, until /quit or the end of the input. Ctrl-C
    stops the reply being written (or clears the line being typed), never the session."""
    prompt = ">> " if sys.stdin.isatty() else ""
    with contextlib.suppress(ImportError):  # line editing and history for input()
        import readline  # noqa: F401
    while True:
        try:
            line = read_message(prompt)
        except EOFError:
            break
        except KeyboardInterrupt:
            print("^C", file=sys.stderr, flush=True)
            continue
        if line is None:
            continue
        if line in ("/quit", "/exit", "/q"):
            break
        if line == "/reset":
            conversation.reset()
            print("shoal chat: the conversation starts over", file=sys.stderr, flush=True)
            continue
        if line in ("/help", "/?"):
            print(COMMANDS, file=sys.stderr, flush=True)
            continue
        if line.startswith("/"):
            print(f"shoal chat: no command {line.split()[0]}; /help lists them",
                  file=sys.stderr, flush=True)
            continue
        with ctrl_c_stops() as stopped:
            turn = conversation.say(line, lambda text: print(text, end="", flush=True),
                                    stop=stopped.is_set)
        print(flush=True)
        spec = turn.speculative
        drafted = "" if spec is None else (
            f"; the MTP module's guesses: {spec.accepted} of {spec.proposed} accepted")
        print(f"[{'stopped: ' if turn.stopped else ''}{turn.tokens} tokens at "
              f"{turn.tokens_per_second:.1f} tok/s; prompt {turn.prompt_tokens} tokens, "
              f"{turn.cached_tokens} from the cache{drafted}]", file=sys.stderr, flush=True)


def read_message(prompt: str) -> str | None:
    """One message: a line, or the lines between two lines of three double quotes; None for
    an empty one."""
    line = input(prompt).strip()
    if line != MULTI_LINE:
        return line or None
    lines = []
    while (more := input("... " if prompt else "")).strip() != MULTI_LINE:
        lines.append(more)
    return "\n".join(lines).strip() or None


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[threading.Event]:
    """While a reply is written, Ctrl-C (SIGINT) sets the event instead of raising, so the
    reply stops between two tokens and the conversation goes on."""
    stopped = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)
