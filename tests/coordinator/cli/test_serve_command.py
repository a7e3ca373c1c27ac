"""`shoal serve` as a user runs it: help, and argument errors said in one line (exit 2)
before anything is loaded or bound."""

import socket

import pytest

from coordinator.cli import shoal_command as cli
from engine.sharding import shard


def run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stopped:
        cli.main(argv)
    return stopped.value.code, capsys.readouterr().err


def test_serve_explains_itself(capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0
    for option in ("--api-key-file", "--host", "--port", "--max-batch", "--prompt-cache-bytes",
                   "--max-body", "--max-connections", "--max-connections-per-host",
                   "/v1/chat/completions", "docs/serving.md"):
        assert option in out


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("serve-cli") / "sharded"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=1, progress=False)
    return out


@pytest.mark.parametrize("extra,message", [
    (["--workers", "127.0.0.1:1", "--cluster", "x"], "not both"),
    (["--port", "70000"], "--port must be between"),
    (["--max-batch", "0"], "--max-batch must be at least 1"),
    (["--prefill-budget", "0"], "--prefill-budget must be above 0"),
    (["--prompt-cache-bytes", "lots"], "not a size"),
    (["--context", "1"], "--context must be at least 2"),
    (["--api-key-file", "/nonexistent/key"], "no API key file"),
    (["--max-body", "lots"], "--max-body takes a size"),
    (["--max-body", "10"], "--max-body takes a size of at least 1K"),
    (["--max-connections", "0"], "--max-connections must be at least 1"),
    (["--max-connections-per-host", "0"], "--max-connections-per-host must be at least 1"),
])
def test_bad_arguments_are_refused_before_loading(extra, message, sharded, secret_file,
                                                   capsys):
    code, err = run(["serve", "--model", str(sharded), "--secret-file", str(secret_file),
                     *extra], capsys)
    assert code == 2 and err.startswith("shoal: error:") and message in err, err
    assert "Traceback" not in err


def test_a_port_in_use_is_said_at_once(sharded, secret_file, capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        code, err = run(["serve", "--model", str(sharded), "--secret-file", str(secret_file),
                         "--workers", "127.0.0.1:1", "--port", str(busy.getsockname()[1])],
                        capsys)
    finally:
        busy.close()
    assert code == 2 and "cannot listen on 127.0.0.1" in err, err
