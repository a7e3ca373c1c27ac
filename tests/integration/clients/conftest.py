"""One cluster for every client test of this folder: two real workers and a server (and a
quiet second server) on a tiny checkpoint whose chat template has tools, started once."""

import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from mlx_lm.utils import load_model, load_tokenizer

from coordinator.ops.local_processes import start_server, start_workers, stop_workers
from engine.sharding import shard
from tests.integration.clients.cluster import KEY, ORIGIN, Page, with_tool_template


@pytest.fixture(scope="package")
def source(tiny_checkpoint, tmp_path_factory) -> Path:
    return with_tool_template(tiny_checkpoint("qwen3_moe"),
                              tmp_path_factory.mktemp("clients") / "source")



@pytest.fixture(scope="package")
def pages():
    """Two web servers on loopback serving a page: a browser page's origins, the first let
    in by --cors-origin, the second not."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Page) for _ in range(2)]
    for httpd in servers:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{httpd.server_address[1]}" for httpd in servers]
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="package")
def workers(source, secret_file):
    root = source.parent
    shard(source, root / "sharded", workers=2, progress=False)
    started = start_workers([[root / "sharded" / "worker-0"], [root / "sharded" / "worker-1"]],
                            secret_file, root / "logs", forked=True)
    yield started
    stop_workers(started)


@pytest.fixture(scope="package")
def server(source, workers, secret_file, pages):
    root = source.parent
    (root / "key").write_text(KEY)
    local = start_server(root / "sharded", [w.address for w in workers], secret_file,
                         root / "serve.log", ("--api-key-file", str(root / "key"),
                                              "--model-id", "tiny", "--cors-origin", ORIGIN,
                                              "--cors-origin", pages[0],
                                              "--prompt-cache-dir", str(root / "cache")))
    yield local
    local.stop()


@pytest.fixture(scope="package")
def quiet_server(source, workers, secret_file):
    """A second server on the same workers, with the defaults the first one changes: no key,
    no CORS; and --log-level warning."""
    root = source.parent
    local = start_server(root / "sharded", [w.address for w in workers], secret_file,
                         root / "quiet.log", ("--model-id", "tiny", "--log-level", "warning",
                                              "--prompt-cache-dir", str(root / "cache")))
    yield local
    local.stop()


@pytest.fixture(scope="package")
def mlx_lm_model(source):
    """The same checkpoint in one process: mlx-lm's own generation is the reference."""
    model, _ = load_model(source)
    return model, load_tokenizer(source)

