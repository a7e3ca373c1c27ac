"""`shoal chat` end to end: the real command on a pipe, over two real workers. Each reply is
mlx-lm's greedy reply to the whole conversation so far, computed in one process, the second
turn takes the first from the KV cache, and /reset starts over."""

import subprocess
import sys

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.generate import encode_messages, generate
from coordinator.local import start_workers, stop_workers
from engine.sharding import shard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint, secret_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    source = tiny_checkpoint("qwen3_moe")
    shard(source, root / "sharded", workers=2, progress=False)
    workers = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs")
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
