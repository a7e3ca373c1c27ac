"""`shoal serve`'s limits as plain code: the connection guard's admissions and evictions,
request bodies refused for their JSON (depth, lone surrogates), prompts refused for their
length before they are tokenized, and failed accepts said once."""

import asyncio
import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from builders.synthetic_tokenizer import build_tokenizer
from coordinator.server.http_limits import ConnectionGuard, Limits, QuietAcceptErrors
from coordinator.server.openai_api import MAX_JSON_DEPTH, decode_body, parse_request
from coordinator.server.prompts import longest_token, prepare
from engine.errors import InvalidInput


def admit(guard: ConnectionGuard, name: str, host: str) -> bool:
    if guard.admit(host):
        guard.opened(name, host)
        return True
    return False


def test_an_address_holds_its_share_and_no_more():
    guard = ConnectionGuard(Limits(max_connections=10, max_connections_per_host=2))
    assert admit(guard, "a1", "10.0.0.1") and admit(guard, "a2", "10.0.0.1")
    assert not admit(guard, "a3", "10.0.0.1")
    assert admit(guard, "b1", "10.0.0.2")
    guard.gone("a1")
    assert admit(guard, "a3", "10.0.0.1")
    assert guard.as_json()["refused"] == 1 and guard.as_json()["open"] == 3


def test_when_full_the_connection_idle_longest_makes_room():
    closed = []
    guard = ConnectionGuard(Limits(max_connections=3, max_connections_per_host=3))
    for name in ("old", "mid", "new"):
        assert admit(guard, name, name)
        guard.idle(name, lambda name=name: closed.append(name))
    guard.busy("old")  # a request in progress is never closed for a newcomer
    assert admit(guard, "fresh", "fresh")
    assert closed == ["mid"]
    guard.busy("new")
    guard.busy("fresh")
    assert not admit(guard, "late", "late")  # every one busy: refused
    assert guard.as_json() == {"open": 3, "idle": 0, "refused": 1, "evicted": 1,
                               "timed_out": 0}


def nested(depth: int, inner: str = "1") -> str:
    return "[" * depth + inner + "]" * depth


@pytest.mark.parametrize("body,message", [
    (nested(100_000).encode(), "nests deeper"),
    (('{"prompt": ' + nested(100_000) + "}").encode(), "nests deeper"),
    (('{"prompt": "x", "model": ' + nested(MAX_JSON_DEPTH) + "}").encode(), "nests deeper"),
    (b'{"prompt": "\\ud800"}', "not valid Unicode"),
    (b'{"\\udc00": 1, "prompt": "x"}', "not valid Unicode"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "not valid Unicode"),
    (b'{"prompt": "\xff"}', "not valid JSON"),
])
def test_bodies_that_would_break_what_reads_them_are_refused(body, message):
    with pytest.raises(InvalidInput, match=message):
        decode_body(body)


def test_bodies_within_the_limits_decode_as_json():
    assert decode_body(nested(MAX_JSON_DEPTH - 1).encode()) == json.loads(
        nested(MAX_JSON_DEPTH - 1))
    assert decode_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001f600"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    return load_tokenizer(folder)


def test_no_token_covers_more_of_a_text_than_the_longest(tokenizer):
    longest = longest_token(tokenizer)
    for text in ("hello there", "the quick brown fox " * 50, "\u00e9t\u00e9 \u2603 " * 20,
                 "<|im_start|>user\nhi<|im_end|>"):
        size = len(text.encode())
        assert len(tokenizer.encode(text)) >= -(-size // longest), text


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(tokenizer):
    calls = []
    original = tokenizer._tokenizer.encode
    tokenizer._tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        for body in ({"prompt": "x" * (1 << 20)},
                     {"messages": [{"role": "user", "content": "x" * (1 << 20)}]}):
            request = parse_request(body, chat="messages" in body)
            with pytest.raises(InvalidInput, match="at least .* tokens"):
                prepare(tokenizer, request, 300, context=4096,
                        longest=longest_token(tokenizer))
        assert not calls
        request = parse_request({"prompt": "hello there"}, chat=False)
        _, ids = prepare(tokenizer, request, 300, context=4096,
                         longest=longest_token(tokenizer))
        assert ids == tokenizer.encode("hello there") and calls
    finally:
        tokenizer._tokenizer.encode = original


def test_failed_accepts_are_said_once_per_interval(capsys):
    loop = asyncio.new_event_loop()
    try:
        handler = QuietAcceptErrors()
        for _ in range(500):
            handler(loop, {"message": "socket.accept() out of system resource",
                           "exception": OSError(24, "Too many open files")})
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "cannot accept connections" in err
        assert "Traceback" not in err
    finally:
        loop.close()


def body_request(chunks: list[bytes], *, then_wait: bool = False, declared: int | None = None):
    """A Starlette request whose body arrives as `chunks`, then (then_wait) never ends."""
    from starlette.requests import Request

    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    if not then_wait:
        messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def read(limits: Limits, request, buffered: int = 0):
    from types import SimpleNamespace

    from coordinator.server.answering import _Held, _read_body

    service = SimpleNamespace(limits=limits, buffered=buffered)
    held = _Held(service)

    async def go() -> bytes:
        try:
            return await _read_body(service, request, held)
        finally:
            held.release()

    try:
        return asyncio.run(go())
    finally:
        assert service.buffered == buffered  # what it held is given back, however it ended


def test_a_body_is_read_within_its_size_and_time():
    from coordinator.server.answering import TooLarge, TooSlow
    from engine.errors import Unavailable

    limits = Limits(max_body=2048, body_timeout=0.2)
    assert read(limits, body_request([b"a" * 1000, b"b" * 1000])) == b"a" * 1000 + b"b" * 1000
    with pytest.raises(TooLarge, match="has 5000 bytes"):
        read(limits, body_request([], declared=5000))
    with pytest.raises(TooLarge, match="over 2048 bytes"):
        read(limits, body_request([b"a" * 1500, b"b" * 1500]))
    with pytest.raises(TooSlow, match="did not arrive within 0.2 s"):
        read(limits, body_request([b"a" * 10], then_wait=True))
    with pytest.raises(Unavailable, match="too many large requests"):
        read(limits, body_request([b"a" * 100]), buffered=limits.max_buffered)
