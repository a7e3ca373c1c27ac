"""Long prompts on `shoal serve`, end to end with real workers, the real server process and the
official `openai` client: a prompt's KV cache comes back from disk after a restart (every
token of it, the same greedy text), a torn file is refused, and a long prefill leaves running
streams flowing. How much sooner the first token comes is benchmarks/long_prompts.py's."""

import random
import statistics
import threading
import time

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.sharding import shard

pytestmark = pytest.mark.slow

LONG = 2200  # prompt tokens: 8 of the cache's 256-token blocks, 4 of serve's 512-token steps


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-cache")
    source = tiny_checkpoint("qwen3_moe")
    sharded = root / "sharded"
    shard(source, sharded, workers=2, progress=False)
    workers = start_workers([[sharded / "worker-0"], [sharded / "worker-1"]], secret_file,
                            root / "logs", forked=True)
    yield source, sharded, workers, root
    stop_workers(workers)


def long_document(source, tokens: int) -> str:
    """Words drawn with a fixed seed until the chat prompt holding them has `tokens` tokens."""
    tokenizer = load_tokenizer(source)
    rng = random.Random(0)
    words = ["river", "stone", "lamp", "quiet", "north", "copper", "field", "seven", "glass",
             "orchard", "signal", "paper", "harbor", "winter", "echo", "meadow"]
    text = ""
    while len(tokenizer.encode(text)) < tokens:
        text += " ".join(rng.choice(words) for _ in range(400)) + ".\n"
    return text


def serve(cluster, secret_file, name: str, *options: str):
    _, sharded, workers, root = cluster
    return start_server(sharded, [w.address for w in workers], secret_file,
                        root / f"{name}.log",
                        ("--model-id", "tiny", "--context", "20000", "--prompt-cache-dir",
                         str(root / "cache"), *options))


def ask(url: str, messages: list[dict]) -> tuple[str, float, object]:
    """(greedy text, seconds to the first streamed token, usage) of a streamed chat."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    started = time.monotonic()
    first, text, usage = None, "", None
    for chunk in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            first = first or time.monotonic() - started
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    return text, first, usage


@pytest.mark.long
def test_a_long_prompt_comes_back_from_disk_after_a_restart_and_a_torn_file_is_refused(
        cluster, secret_file):
    document = long_document(cluster[0], LONG)
    opening = [{"role": "user", "content": document}]
    server = serve(cluster, secret_file, "first")
    try:
        answer, cold, usage = ask(server.url, opening)
        assert usage.prompt_tokens >= LONG and usage.prompt_tokens_details.cached_tokens == 0
        follow_up = opening + [{"role": "assistant", "content": answer},
                               {"role": "user", "content": "Which word came first?"}]
        expected, _, usage = ask(server.url, follow_up)
        assert usage.prompt_tokens_details.model_extra["cache_tier"] == "memory"
    finally:
        server.stop()
    files = sorted((cluster[3] / "cache").rglob("*.safetensors"))
    assert files, "no prompt cache file was written"

    server = serve(cluster, secret_file, "second")
    try:
        text, warm, usage = ask(server.url, follow_up)
    finally:
        server.stop()
    assert text == expected
    assert usage.prompt_tokens_details.cached_tokens >= LONG
    assert usage.prompt_tokens_details.model_extra["cache_tier"] == "disk"
    print(f"time to first token: cold {cold:.2f} s, from disk {warm:.2f} s")

    for path in sorted((cluster[3] / "cache").rglob("*.safetensors")):
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])  # a write torn halfway
    server = serve(cluster, secret_file, "third")
    try:
        text, _, usage = ask(server.url, follow_up)
    finally:
        server.stop()
    assert text == expected
    assert usage.prompt_tokens_details.cached_tokens == 0
    log = (cluster[3] / "third.log").read_text()
    assert "does not match its checksum" in log and "computing the prompt again" in log


ARRIVING = 2048  # prompt tokens arriving while four streams decode: 32 pieces of PREFILL_STEP
PREFILL_STEP = 64


def stream_times(client: openai.OpenAI, prompt: str, times: list[float],
                 stop: threading.Event) -> None:
    """Note when each token of a streamed completion arrives (logprobs: a chunk per token)
    until `stop` is set, then hang up."""
    with client.completions.create(model="tiny", prompt=prompt, max_tokens=8000,
                                   temperature=0, stream=True, logprobs=0) as chunks:
        for _ in chunks:
            times.append(time.monotonic())
            if stop.is_set():
                break


def test_a_long_prompt_is_prefilled_between_the_running_streams_decode_steps(
        cluster, secret_file):
    document = long_document(cluster[0], ARRIVING)
    # no prompt cache: the prompt alone is computed as it was beside the streams
    server = serve(cluster, secret_file, "prefill", "--prefill-step", str(PREFILL_STEP),
                   "--prompt-cache-bytes", "1K", "--prompt-cache-disk", "0")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=600)
    times: list[list[float]] = [[] for _ in range(4)]
    stop = threading.Event()
    threads = [threading.Thread(target=stream_times, args=(client, f"stream {i} says",
                                                           times[i], stop))
               for i in range(4)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while min(map(len, times)) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        arrival = time.monotonic()
        beside, prefill, usage = ask(server.url, [{"role": "user", "content": document}])
        stop.set()
        for t in threads:
            t.join(60)
        alone, _, _ = ask(server.url, [{"role": "user", "content": document}])
    finally:
        stop.set()
        server.stop()
    assert usage.prompt_tokens >= ARRIVING and beside == alone
    for i, stamps in enumerate(times):
        gaps = [(b, b - a) for a, b in zip(stamps, stamps[1:], strict=False)]
        before = [g for at, g in gaps if at < arrival]
        during = [g for at, g in gaps if arrival <= at <= arrival + prefill]
        assert len(before) >= 20 and stamps[-1] > arrival + prefill, i  # it ran throughout
        median = statistics.median(before)
        print(f"stream {i}: median gap before {median * 1000:.1f} ms; while a {ARRIVING}-token "
              f"prompt took {prefill:.2f} s to its first token, {len(during)} tokens, the "
              f"longest gap {max(during) * 1000:.0f} ms")
        # Decoding went on through the prefill, in pieces sized by time: no gap near the
        # whole prefill's time (a step with any piece costs a pass over the cluster, so the
        # gap stays above a decode step's: docs/serving.md).
        assert len(during) >= 20 and max(during) <= prefill / 4, (i, max(during), prefill)
