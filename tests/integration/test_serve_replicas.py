"""`shoal serve` while a worker is lost whose experts have another copy: the answer in
flight goes on and is the one it gets with every worker up."""

import httpx2 as httpx  # the HTTP client the openai package is built on
import openai
import pytest

from coordinator.ops.local_processes import start_server, start_workers, stop_workers

pytestmark = pytest.mark.slow


@pytest.mark.long
def test_a_lost_worker_with_copies_elsewhere_is_routed_around(replicated_stores, secret_file,
                                                               tmp_path):
    sharded, stores = replicated_stores
    workers = start_workers([[s] for s in stores], secret_file, tmp_path / "logs", forked=True)
    server = None
    try:
        server = start_server(sharded, [w.address for w in workers], secret_file,
                              tmp_path / "serve.log",
                              ("--prompt-cache-dir", str(tmp_path / "prompt-cache")))
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=60)

        def ask(stream: bool):
            return client.completions.create(model="sharded", prompt="hello there", max_tokens=600,
                                             temperature=0, stream=stream)

        expected = ask(False).choices[0].text
        chunks = iter(ask(True))
        text = next(chunks).choices[0].text
        workers[1].stop()  # the copies on the first worker take over
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["requests_in_flight"] == 1, "the answer ended before the worker did"
        text += "".join(c.choices[0].text for c in chunks)
        assert text == expected
        assert httpx.get(server.url + "/health", timeout=10).json()["workers"] == 1
    finally:
        if server is not None:
            server.stop()
        stop_workers(workers)
