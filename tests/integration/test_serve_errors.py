"""What a newcomer's mistakes get from `shoal serve`, through each API's official client: a
key made by `shoal api-key`, a wrong or missing key answered in each API's own error shape,
and a model name the server does not serve refused with a 404 that names the one it does."""

import subprocess
import sys
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.sharding import shard

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HI = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, secret_file, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-errors")
    shard(tiny_checkpoint("qwen3_moe"), root / "sharded", workers=2, progress=False)
    made = subprocess.run([sys.executable, "-m", "coordinator.cli", "api-key",
                           str(root / "key")], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert made.returncode == 0, made.stderr
    assert (root / "key").stat().st_mode & 0o777 == 0o600
    again = subprocess.run([sys.executable, "-m", "coordinator.cli", "api-key",
                            str(root / "key")], capture_output=True, text=True, timeout=60,
                           cwd=REPO)
    assert again.returncode == 2 and "already exists" in again.stderr  # never overwritten
    workers = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs", forked=True)
    server = start_server(root / "sharded", [w.address for w in workers], secret_file,
                          root / "serve.log", ("--api-key-file", str(root / "key"),
                                               "--model-id", "tiny"))
    yield server.url, (root / "key").read_text().strip()
    server.stop()
    stop_workers(workers)


def test_the_key_made_by_shoal_api_key_is_the_one_served(served):
    url, key = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(model="tiny", messages=HI, max_tokens=3)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_an_unknown_model_is_a_404_naming_the_served_one_in_every_api(served):
    url, key = served
    with pytest.raises(openai.NotFoundError, match="'tiny'"):
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0).chat.completions.create(
            model="gpt-4o", messages=HI, max_tokens=3)
    with pytest.raises(anthropic.NotFoundError) as caught:
        anthropic.Anthropic(base_url=url, api_key=key, max_retries=0).messages.create(
            model="claude-sonnet-4", messages=HI, max_tokens=3)
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "'tiny'" in caught.value.body["error"]["message"]
    client = ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"})
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model="llama3", messages=HI)
    assert refused.value.status_code == 404 and "'tiny'" in refused.value.error
    assert client.chat(model="tiny:latest", messages=HI, options={"num_predict": 2}).done


def test_a_wrong_key_is_answered_in_each_apis_own_error_shape(served):
    url, _ = served
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert caught.value.body["type"] == "invalid_request_error"  # OpenAI's error object
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=HI, max_tokens=3)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=url).chat(model="tiny", messages=HI)
    assert refused.value.status_code == 401 and "API key" in refused.value.error
