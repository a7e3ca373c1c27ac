"""`shoal chat` end to end: the real command on a pipe, over two real workers. Each reply is
mlx-lm's greedy reply to the whole conversation so far, computed in one process, the second
turn takes the first from the KV cache, and /reset starts over. Also the KV-cache
quantization of `shoal chat` and `shoal generate` against mlx-lm's with the same flags, and
prompt cache files against mlx-lm's."""

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from unittest.mock import patch

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.utils import load_model, load_tokenizer

from builders.synthetic import build_checkpoint
from builders.synthetic_config import SHAPES
from coordinator.decoding.chat import Conversation
from coordinator.decoding.generate import encode_messages, generate, open_remote_model
from coordinator.ops.local_processes import start_workers, stop_workers
from engine.auth import load_secret
from engine.errors import ShoalError
from engine.sharding import shard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    source = tiny_checkpoint("qwen3_moe")
    shard(source, root / "sharded", workers=2, progress=False)
    workers = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs", forked=True)
    yield source, root / "sharded", workers
    stop_workers(workers)


def test_a_conversation_equals_mlx_lm_turn_by_turn(cluster, secret_file):
    source, sharded, workers = cluster
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)

    def reply(messages: list[dict]) -> str:
        return generate(model, tokenizer, encode_messages(tokenizer, messages),
                        max_tokens=10).text

    first = [{"role": "user", "content": "Hello there"}]
    one = reply(first)
    second = [*first, {"role": "assistant", "content": one},
              {"role": "user", "content": "And then?"}]
    two = reply(second)
    assert one and two
    done = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "chat", "--model", str(sharded),
         "--workers", ",".join(w.address for w in workers), "--secret-file",
         str(secret_file), "--max-tokens", "10"],
        input="Hello there\nAnd then?\n/reset\nHello there\n/quit\n", capture_output=True,
        text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{one}\n{two}\n{one}\n"
    turns = [line for line in done.stderr.splitlines() if "from the cache]" in line]
    assert len(turns) == 3, done.stderr
    cached = [int(line.split(", ")[-1].split()[0]) for line in turns]
    assert cached[0] == 0 and cached[1] >= len(encode_messages(tokenizer, first)) and (
        cached[2] == 0)
    assert "starts over" in done.stderr


@pytest.fixture(scope="module")
def wide_heads(secret_file, tmp_path_factory):
    """The tiny qwen3_moe with 32-wide attention heads: MLX quantizes in groups of 32 at
    least, which the tiny model's 16-wide heads cannot be."""
    root = tmp_path_factory.mktemp("wide-heads")
    with patch.dict(SHAPES, {"tiny": replace(SHAPES["tiny"], head_dim=32)}):
        source = build_checkpoint(root / "source", "qwen3_moe")
    shard(source, root / "sharded", workers=2, progress=False)
    workers = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs", forked=True)
    yield source, root / "sharded", workers
    stop_workers(workers)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_quantized_kv_cache_gives_mlx_lms_tokens_with_the_same_flags(wide_heads, secret_file,
                                                                      command):
    """--kv-bits 4 from the first token: `shoal generate` and `shoal chat` give the tokens
    mlx-lm's stream_generate gives with the same settings, and they differ from the
    unquantized cache's (so the flags reach the cache)."""
    source, sharded, workers = wide_heads
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    kv = {"kv_bits": 4, "kv_group_size": 32, "quantized_kv_start": 0}
    messages = [{"role": "user", "content": "Tell me about the fish in the sea"}]
    prompt = encode_messages(tokenizer, messages)

    def mlx_lm(**settings) -> list[int]:
        out = []
        for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=24,
                                 **settings):
            if r.finish_reason == "stop" and r.token in tokenizer.eos_token_ids:
                break
            out.append(r.token)
        return out

    quantized, plain = mlx_lm(**kv), mlx_lm()
    assert quantized != plain
    flags = ["--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "0",
             "--max-tokens", "24"]
    common = ["--model", str(sharded), "--workers", ",".join(w.address for w in workers),
              "--secret-file", str(secret_file), *flags]
    if command == "generate":
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", "generate", "--chat",
                               messages[0]["content"], "--json", *common],
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["token_ids"] == quantized
    else:
        done = subprocess.run([sys.executable, "-m", "coordinator.cli", "chat", *common],
                              input=messages[0]["content"] + "\n", capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        assert done.stdout == generate_text(tokenizer, quantized) + "\n"


def generate_text(tokenizer, tokens: list[int]) -> str:
    """The text mlx-lm's streaming detokenizer makes of `tokens` (the first space dropped)."""
    detokenizer = tokenizer.detokenizer
    for t in tokens:
        detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


def test_prompt_cache_files_are_mlx_lms_both_ways(cluster, secret_file, tmp_path):
    """`shoal cache-prompt` writes the file mlx-lm's cache_prompt writes (every array bit for
    bit), and `shoal generate --prompt-cache-file` continues mlx-lm's file as mlx-lm's
    generate does (the same text), computing only the question."""
    source, sharded, workers = cluster
    context = "A shoal of fish moves as one, yet every fish swims on its own."
    ours, theirs = tmp_path / "shoal.safetensors", tmp_path / "mlx-lm.safetensors"
    cluster_args = ["--model", str(sharded), "--workers", ",".join(w.address for w in workers),
                    "--secret-file", str(secret_file)]
    made = subprocess.run([sys.executable, "-m", "coordinator.cli", "cache-prompt", context,
                           "--prompt-cache-file", str(ours), *cluster_args],
                          capture_output=True, text=True, timeout=180)
    assert made.returncode == 0, made.stderr
    made = subprocess.run([sys.executable, "-m", "mlx_lm", "cache_prompt", "--model",
                           str(source), "--prompt", context, "--prompt-cache-file", str(theirs)],
                          capture_output=True, text=True, timeout=180)
    assert made.returncode == 0, made.stderr
    a, b = mx.load(str(ours)), mx.load(str(theirs))
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert a[key].shape == b[key].shape and mx.array_equal(a[key], b[key]).item(), key

    question = "Why do they swim?"
    answer = subprocess.run([sys.executable, "-m", "coordinator.cli", "generate", "--chat",
                             question, "--prompt-cache-file", str(theirs), "--json",
                             "--max-tokens", "12", *cluster_args],
                            capture_output=True, text=True, timeout=180)
    assert answer.returncode == 0, answer.stderr
    report = json.loads(answer.stdout)
    reference = subprocess.run([sys.executable, "-m", "mlx_lm", "generate", "--model",
                                str(source), "--prompt-cache-file", str(theirs), "--prompt",
                                question, "--max-tokens", "12", "--verbose", "F"],
                               capture_output=True, text=True, timeout=180)
    assert reference.returncode == 0, reference.stderr
    assert report["text"] + "\n" == reference.stdout
    computed = load_tokenizer(source).decode(report["prompt_token_ids"])
    assert question in computed and "shoal" not in computed  # the question, not the context


class Terminal:
    """A command on a pseudo-terminal, as a person at a shell runs it: Ctrl-C written to the
    terminal reaches the command as SIGINT, and input() sees a tty (so readline edits)."""

    def __init__(self, argv: list[str]) -> None:
        import pty

        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the terminal's session leader
            os.execv(argv[0], argv)
        self.seen = b""

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def expect(self, text: str, seconds: float = 120) -> str:
        """Everything shown until `text` appears (after what earlier calls consumed)."""
        deadline = time.monotonic() + seconds
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not shown; the terminal shows: {self.seen[-3000:]!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    self.seen += os.read(self.fd, 65536)
                except OSError:  # the command ended and the terminal closed
                    assert text.encode() in self.seen, self.seen[-3000:]
        shown, _, self.seen = self.seen.partition(text.encode())
        return shown.decode(errors="replace") + text

    def shows_more(self, count: int, seconds: float = 120) -> None:
        """Wait until `count` bytes are shown beyond what expect() consumed (bounded)."""
        import select

        deadline = time.monotonic() + seconds
        while len(self.seen) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"{count} bytes not shown; the terminal shows: {self.seen!r}"
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                self.seen += os.read(self.fd, 65536)

    def close(self) -> int:
        for _ in range(300):
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            try:  # never blocks: a command that did not end must not hang the test
                if select.select([self.fd], [], [], 0.1)[0]:
                    os.read(self.fd, 65536)
            except OSError:
                time.sleep(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError("the chat did not end")


def _chat_in_terminal(cluster, secret_file) -> Terminal:
    """`shoal chat` over the module's workers in a terminal, replies long enough to stop."""
    _, sharded, workers = cluster
    return Terminal([sys.executable, "-m", "coordinator.cli", "chat", "--model", str(sharded),
                     "--workers", ",".join(w.address for w in workers), "--secret-file",
                     str(secret_file), "--max-tokens", "100000"])


def test_ctrl_c_stops_the_reply_not_the_session_and_the_line_edits(cluster, secret_file):
    """In a terminal: Ctrl-C mid-reply stops that reply and the chat goes on (the workers'
    lanes still answer), readline's Ctrl-A and Up arrow edit and recall a line, /help lists
    the commands, and a message of several lines between two lines of three quotes is one
    message."""
    chat = _chat_in_terminal(cluster, secret_file)
    try:
        chat.expect(">> ")
        chat.send(b"Tell me everything\r")
        # the line's echo, then the reply: the random tiny model writes on and on; stop it
        # once it has written some
        chat.shows_more(250)
        chat.send(b"\x03")
        assert "[stopped: " in chat.expect("from the cache]")
        chat.expect(">> ")
        chat.send(b"elp\x01/h\r")  # Ctrl-A: to the start of the line, where "/h" goes
        assert "/reset" in chat.expect("earlier messages")
        chat.send(b"\x1b[A\r")  # Up: the line before, /help, again
        chat.expect("earlier messages")
        chat.send(b'"""\rfirst line\rsecond line\r"""\r')
        chat.shows_more(300)  # the lines' echo, then some of the reply
        chat.send(b"\x03")
        turn = chat.expect("from the cache]")
        assert "... " in turn and turn.count("tokens at") == 1  # one message, one reply
        chat.send(b"/quit\r")
    finally:
        code = chat.close()
    assert code == 0


@pytest.fixture
def own_cluster(tiny_checkpoint, tmp_path, start_worker):
    """Two workers of this test's own (it kills one), on a split of its own."""
    sharded = tmp_path / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), sharded, workers=2, progress=False)
    return sharded, [start_worker([sharded / f"worker-{k}"], "--no-advertise")
                     for k in range(2)]


def test_a_worker_killed_mid_reply_fails_that_reply_and_keeps_the_conversation(
    own_cluster, secret_file
):
    sharded, workers = own_cluster
    remote = open_remote_model(sharded, [w.address for w in workers],
                               load_secret(secret_file))
    try:
        conversation = Conversation(remote.model, remote.tokenizer, max_tokens=8)
        first = conversation.say("Hello there", lambda text: None)
        before = list(conversation.messages)
        assert first.text and before[-1] == {"role": "assistant", "content": first.text}
        conversation.max_tokens = 100_000
        shown = []

        def kill_after_a_few(text: str) -> None:
            shown.append(text)
            if len(shown) == 5:
                os.kill(workers[1].proc.pid, signal.SIGKILL)

        started = time.monotonic()
        with pytest.raises(ShoalError):
            conversation.say("Tell me everything", kill_after_a_few)
        assert time.monotonic() - started < 60  # bounded: the loss is seen, not waited out
        assert conversation.messages == before  # the failed turn left nothing behind
        assert conversation.cached == []  # and its cache starts again
    finally:
        remote.close()


def test_chat_says_the_error_of_a_reply_and_goes_on(own_cluster, secret_file):
    """The real command on a pipe: the worker is killed by PID while the reply streams; the
    reply ends with an error line, and the session still answers /help and ends with /quit."""
    sharded, workers = own_cluster
    chat = subprocess.Popen(
        [sys.executable, "-m", "coordinator.cli", "chat", "--model", str(sharded),
         "--workers", ",".join(w.address for w in workers), "--secret-file",
         str(secret_file), "--max-tokens", "100000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        chat.stdin.write(b"Tell me everything\n")
        chat.stdin.flush()
        assert chat.stdout.read(20)  # the reply streams (bounded by the timeout below)
        os.kill(workers[1].proc.pid, signal.SIGKILL)
        out, err = chat.communicate(b"/help\n/quit\n", timeout=120)
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait()
    text = err.decode()
    assert chat.returncode == 0, text
    assert "shoal chat: error: " in text and "the conversation before it is kept" in text
    assert "earlier messages" in text  # /help answered after the error
    assert "Traceback" not in text


def test_a_reply_stopped_shows_no_token_computed_after_the_stop(tiny_checkpoint):
    """Ctrl-C while a token is being computed: that token is not shown. The stop comes
    from inside the computation (the sampler of the third token), as a key pressed then."""
    model, _ = load_model(tiny_checkpoint("qwen3_moe"))
    tokenizer = load_tokenizer(tiny_checkpoint("qwen3_moe"))
    conversation = Conversation(model, tokenizer, max_tokens=50)
    pressed, samples = threading.Event(), []
    plain = conversation.sampler

    def sampler(logits):
        samples.append(1)
        if len(samples) == 3:
            pressed.set()
        return plain(logits)

    conversation.sampler = sampler
    shown_after = []
    turn = conversation.say("Hello there", lambda text: shown_after.append(pressed.is_set()),
                            stop=pressed.is_set)
    assert turn.stopped and shown_after and not any(shown_after)


def test_typing_during_a_reply_is_not_echoed_into_it_and_ctrl_d_ends_the_line(
    cluster, secret_file
):
    """In a terminal: keys typed while a reply streams do not show inside it, and Ctrl-D at
    the prompt leaves the shell a line of its own."""
    chat = _chat_in_terminal(cluster, secret_file)
    try:
        chat.expect(">> ")
        chat.send(b"Tell me everything\r")
        chat.shows_more(250)
        chat.send(b"qqzz")  # typed mid-reply
        time.sleep(1)
        chat.send(b"\x03")
        reply = chat.expect("from the cache]", 30)
        assert "qqzz" not in reply, reply
        chat.expect(">> ", 30)
        chat.send(b"\x15\x04")  # Ctrl-U clears the line, Ctrl-D on the empty line ends it
        assert b"qqzz" not in chat.seen
        chat.expect("\r\n", 30)  # the shell's prompt will start a line of its own
    finally:
        code = chat.close()
    assert code == 0
