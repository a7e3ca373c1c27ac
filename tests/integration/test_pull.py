"""`shoal pull` and `shoal shard ORG/NAME` against a loopback stand-in of the Hugging Face
Hub's file API (repository info, file tree, resolve with HEAD and ranged GET): the download
lands in the Hugging Face cache and shard reads it by repository id without a network; a pull
killed mid-file resumes where it stopped; no hub, or offline mode, ends with one clear error."""

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.sharding import shard

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "org/tiny-moe"
COMMIT = "c0ffee" * 6 + "c0ff"  # 40 hex digits


class StandInHub(ThreadingHTTPServer):
    """The few Hub endpoints huggingface_hub's snapshot_download uses, serving `files`.
    `stall` names a file whose first GET sends half its bytes and then waits for `release`
    (or, with `drop`, closes the connection)."""

    daemon_threads = True

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files = files
        self.ranges: list[tuple[str, str | None]] = []  # (file, Range header) of each GET
        self.stall: str | None = None
        self.drop = False  # close the stalled connection at once instead of waiting
        self.stalled = threading.Event()
        self.release = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _file(self, head: bool) -> None:
        name = self.path.split(f"/resolve/{COMMIT}/", 1)[-1]
        if f"/{REPO_ID}/resolve/" not in self.path or name not in self.server.files:
            self.send_error(404)
            return
        data = self.server.files[name]
        start = 0
        if not head:
            header = self.headers.get("Range")
            self.server.ranges.append((name, header))
            if header:
                start = int(header.removeprefix("bytes=").split("-")[0])
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        body = data[start:]
        if name == self.server.stall and not self.server.stalled.is_set():
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.server.stalled.set()
            if not self.server.drop:
                self.server.release.wait(60)
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._file(head=True)

    def do_GET(self) -> None:
        files = self.server.files
        if self.path.startswith(f"/api/models/{REPO_ID}/revision/"):
            self._json({"id": REPO_ID, "sha": COMMIT,
                        "siblings": [{"rfilename": name} for name in files]})
        elif self.path.startswith(f"/api/models/{REPO_ID}/tree/"):
            self._json([{"type": "file", "path": name, "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()}
                        for name, data in sorted(files.items())])
        elif self.path.startswith("/api/"):
            self.send_error(404)
        else:
            self._file(head=False)


@pytest.fixture
def hub(tiny_checkpoint):
    source = tiny_checkpoint("qwen3_moe")
    files = {p.name: p.read_bytes() for p in source.iterdir() if p.is_file()}
    server = StandInHub(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(10)


def as_from_a_terminal() -> None:
    """In the child, before it runs: SIGINT as a command started from a terminal gets it
    (a process inherits SIGINT ignored or blocked). In two whole-suite runs the child did
    not act on the Ctrl-C for over 10 s, while runs of this file alone always did; the
    suspect, not proven, is a library an earlier test loaded into the suite's process."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def hub_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint,
            "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def shoal(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)


def dead_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def cached_snapshot(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub" / "models--org--tiny-moe" / "snapshots" / COMMIT


def test_pull_fills_the_cache_and_shard_reads_it_by_repository_id_offline(hub, tmp_path,
                                                                          tiny_checkpoint):
    source = tiny_checkpoint("qwen3_moe")
    before = shoal(hub_env(tmp_path, hub.url), "shard", REPO_ID, str(tmp_path / "early"))
    assert before.returncode == 2
    assert before.stderr.startswith(f"shoal: error: {REPO_ID} is not a folder here, nor in")
    assert f"`shoal pull {REPO_ID}`" in before.stderr and "hf download" in before.stderr

    pulled = shoal(hub_env(tmp_path, hub.url), "pull", REPO_ID)
    assert pulled.returncode == 0, pulled.stderr
    snapshot = cached_snapshot(tmp_path)
    assert f"{REPO_ID} -> {snapshot}" in pulled.stdout
    assert "Fetching 6 files: 100%" in pulled.stderr  # huggingface_hub's progress bar
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == hub.files

    planned = shoal(hub_env(tmp_path, dead_endpoint()), "plan", "--model", REPO_ID,
                    "--worker", "a=1G", "--json")
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["model"]["source_bytes"] == sum(
        len(data) for name, data in hub.files.items() if name.endswith(".safetensors"))

    # No hub reachable now: shard reads the cache, and gives what sharding the source gives.
    out = tmp_path / "out"
    sharded = shoal(hub_env(tmp_path, dead_endpoint()), "shard", REPO_ID, str(out), "--quiet")
    assert sharded.returncode == 0, sharded.stderr
    direct = shard(source, tmp_path / "direct", progress=False)
    assert json.loads((out / "manifest.json").read_text())["fingerprint"] == direct.fingerprint

    again = shoal(hub_env(tmp_path, hub.url), "pull", REPO_ID, "--quiet")
    assert again.returncode == 0, again.stderr
    assert [name for name, _ in hub.ranges].count("config.json") == 1  # not fetched twice


def test_a_dropped_connection_resumes_mid_file(hub, tmp_path):
    big = os.urandom(24 << 20)  # beyond huggingface_hub's 10 MiB write chunks
    hub.files["model-big.safetensors"] = big
    hub.stall, hub.drop = "model-big.safetensors", True
    pulled = shoal(hub_env(tmp_path, hub.url), "pull", REPO_ID, "--quiet")
    assert pulled.returncode == 0, pulled.stderr
    gets = [header for name, header in hub.ranges if name == "model-big.safetensors"]
    assert len(gets) == 2 and gets[0] is None and gets[1].startswith("bytes=")
    assert 0 < int(gets[1].removeprefix("bytes=").rstrip("-")) <= len(big) // 2
    assert (cached_snapshot(tmp_path) / "model-big.safetensors").read_bytes() == big


def test_ctrl_c_stops_a_pull_at_once_and_it_keeps_the_files_it_finished(hub, tmp_path):
    hub.files["model-big.safetensors"] = os.urandom(24 << 20)
    hub.stall = "model-big.safetensors"
    env = hub_env(tmp_path, hub.url, HF_HUB_DOWNLOAD_WORKERS="1")
    proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", "pull", REPO_ID,
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, env=env, preexec_fn=as_from_a_terminal)
    try:
        assert hub.stalled.wait(60), "the download never reached the big file"
        proc.send_signal(signal.SIGINT)  # Ctrl-C, while the big file is half there
        # at once, not when the file is done: the stand-in holds it for 60 s (a loaded 2-core
        # machine has taken more than 10 s to run the child's handler)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        hub.release.set()
    assert proc.returncode == 130 and b"shoal: interrupted" in err, err.decode()
    blobs = tmp_path / "hf" / "hub" / "models--org--tiny-moe" / "blobs"
    assert not list(blobs.glob("*.incomplete"))
    finished = {name for name, _ in hub.ranges if name != "model-big.safetensors"}
    hub.ranges.clear()
    again = shoal(env, "pull", REPO_ID, "--quiet")
    assert again.returncode == 0, again.stderr
    fetched = [name for name, _ in hub.ranges]
    assert "model-big.safetensors" in fetched and not finished & set(fetched)
    assert {p.name: p.read_bytes() for p in cached_snapshot(tmp_path).iterdir()} == hub.files


def test_no_hub_or_offline_mode_ends_with_one_clear_error(tmp_path):
    for env in (hub_env(tmp_path, dead_endpoint()),
                hub_env(tmp_path, dead_endpoint(), HF_HUB_OFFLINE="1")):
        run = shoal(env, "pull", REPO_ID)
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().splitlines()
        assert lines[-1].startswith(f"shoal: error: cannot download {REPO_ID}: "), run.stderr
        assert "Traceback" not in run.stderr
    assert "HF_HUB_OFFLINE is set" in lines[-1]
    assert not list((tmp_path / "hf").rglob("*.safetensors"))
    shutil.rmtree(tmp_path / "hf", ignore_errors=True)
