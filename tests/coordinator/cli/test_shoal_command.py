"""The shoal and shoal-worker commands as a user runs them: help, errors, generate --json."""

import json
import os
import stat
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, load_tokenizer

from engine.auth import create_secret
from engine.sharding import shard

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def shoal(*args: str, timeout: float = 180, module: str = "coordinator.cli"):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("args", [
    ("--help",), ("shard", "--help"), ("generate", "--help"), ("cluster-init", "--help"),
    ("workers", "--help"), ("plan", "--help"), ("bench", "--help"), ("demo", "--help"),
    ("doctor", "--help"), ("serve", "--help"),
])
@pytest.mark.processes
def test_every_command_explains_itself(args):
    run = shoal(*args)
    assert run.returncode == 0
    assert "usage: shoal" in run.stdout and len(run.stdout) > 300
    assert "this Mac" not in run.stdout  # it runs on Linux too: "this machine"


@pytest.mark.processes
def test_worker_explains_itself():
    run = shoal("--help", module="worker.daemon")
    assert run.returncode == 0 and "--store" in run.stdout and "checksum" in run.stdout
    run = shoal("--version", module="worker.daemon")
    assert run.returncode == 0 and run.stdout.startswith("shoal-worker 0.")


@pytest.mark.processes
def test_cluster_init_writes_a_private_secret_once(tmp_path):
    path = tmp_path / "cfg" / "secret"
    run = shoal("cluster-init", "--secret-file", str(path))
    assert run.returncode == 0, run.stderr
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = shoal("cluster-init", "--secret-file", str(path))
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.processes
def test_worker_without_secret_says_how_to_make_one(tmp_path):
    run = shoal("--store", str(tmp_path), "--secret-file", str(tmp_path / "none"),
                module="worker.daemon")
    assert run.returncode == 2 and "shoal cluster-init" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard(tiny_checkpoint("mixtral"), out, workers=2, progress=False)
    return out


@pytest.mark.processes
@pytest.mark.slow
def test_generate_json_matches_mlx_lm_and_reports_stats(
    sharded, tiny_checkpoint, start_worker, secret_file
):
    workers = [start_worker([sharded / f"worker-{k}"]) for k in range(2)]
    run = shoal("generate", "--model", str(sharded), "--workers",
                ",".join(w.address for w in workers), "--secret-file", str(secret_file),
                "--max-tokens", "10", "--json", "--stats", "hello world")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    for key in ("prompt_token_ids", "token_ids", "text", "prefill_tps", "decode_tps"):
        assert key in report
    assert report["stats"]["layers"].keys() == {"0", "1", "2"}
    assert report["stats"]["bytes_sent_per_token"] > 0

    source = tiny_checkpoint("mixtral")
    model, _ = load_model(source)
    tokenizer = load_tokenizer(source)
    assert report["prompt_token_ids"] == tokenizer.encode("hello world")
    expected = [int(t) for t, _ in generate_step(mx.array(report["prompt_token_ids"]), model,
                                                 max_tokens=10)]
    expected = expected[: next((i for i, t in enumerate(expected)
                                if t in tokenizer.eos_token_ids), len(expected))]
    assert report["token_ids"] == expected


@pytest.mark.processes
@pytest.mark.slow
def test_generate_names_missing_experts_and_wrong_secret(
    sharded, start_worker, secret_file, tmp_path
):
    only_half = start_worker([sharded / "worker-0"])
    run = shoal("generate", "--model", str(sharded), "--workers", only_half.address,
                "--secret-file", str(secret_file), "hi")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "no live worker holds these experts: layer 0: experts 1, 3, 5, 7" in run.stderr

    wrong = create_secret(tmp_path / "wrong")
    run = shoal("generate", "--model", str(sharded), "--workers", only_half.address,
                "--secret-file", str(wrong), "hi")
    assert run.returncode == 2 and "refused this cluster's TLS identity" in run.stderr
    assert "cluster secret" in run.stderr


@pytest.mark.processes
def test_an_unexpected_io_error_is_one_line_naming_the_path(sharded, tmp_path):
    """A path the OS refuses where no command expected it ends the command with `shoal:
    error: PATH: PROBLEM`, status 2, no traceback: a secret asked for under a file, a heat
    record that is a folder."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    record = sharded / "heat.msgpack"
    record.mkdir()
    for args, line in [
        (("cluster-init", "--secret-file", str(a_file / "secret")), f"{a_file}: File exists"),
        (("heat", "--model", str(sharded), "--reset"), f"{record}: Is a directory"),
    ]:
        run = shoal(*args)
        assert (run.returncode, run.stderr) == (2, f"shoal: error: {line}\n")


@pytest.mark.processes
def test_version_and_help_say_what_a_newcomer_needs():
    run = shoal("--version")
    assert run.returncode == 0 and run.stdout.startswith("shoal 0.") and "protocol" in run.stdout
    generate_help = shoal("generate", "--help").stdout
    assert "--max-tokens N" in generate_help and "(default 100)" in generate_help
    shard_help = " ".join(shoal("shard", "--help").stdout.split())
    demo_help = " ".join(shoal("demo", "--help").stdout.split())
    assert "default: E/4" in demo_help and "dense model's" in demo_help
    assert "(default 60)" in demo_help
    run = shoal("demo", "--max-tokens", "0")
    assert run.returncode == 2 and "--max-tokens must be at least 1" in run.stderr
    assert "MODEL the source checkpoint" in shard_help and "shoal pull ORG/NAME" in shard_help
    assert "OUT_DIR where to write" in shard_help


@pytest.mark.processes
def test_generate_refuses_bad_arguments_and_dead_workers_before_loading(sharded, secret_file):
    import time

    run = shoal("generate", "--model", str(sharded), "--workers", "127.0.0.1:1",
                "--secret-file", str(secret_file), "--max-tokens", "0", "hi")
    assert run.returncode == 2 and "--max-tokens must be at least 1, got 0" in run.stderr
    started = time.monotonic()
    run = shoal("generate", "--model", str(sharded), "--workers", "127.0.0.1:1",
                "--secret-file", str(secret_file), "hi")
    assert run.returncode == 2 and "refused at once" in run.stderr, run.stderr
    # at once: not after --wait's 30 s (a loaded machine takes seconds to start the command)
    assert "did not answer" not in run.stderr and time.monotonic() - started < 25
    run = shoal("heat", "--model", str(sharded), "--workers", "127.0.0.1:1",
                "--secret-file", str(secret_file))
    assert run.returncode == 2 and "refused at once" in run.stderr, run.stderr
    run = shoal("generate", "--model", str(sharded / "dense"), "--workers", "127.0.0.1:1",
                "--secret-file", str(secret_file), "hi")
    assert run.returncode == 2 and "not a folder written by `shoal shard`" in run.stderr


def test_streamed_text_ends_its_line_before_anything_else_is_said(capsys):
    from coordinator.cli.generate_command import StreamedText

    out = StreamedText()
    out.write("The capital is Par")
    out.end_line()
    out.end_line()  # once only
    out.write("is.\n")
    out.end_line()  # already at a line start
    assert capsys.readouterr().out == "The capital is Par\nis.\n"


def mlx_lm_tokens(source, prompt_ids: list[int], count: int) -> list[int]:
    model, _ = load_model(source)
    eos = load_tokenizer(source).eos_token_ids
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt_ids), model, max_tokens=count)]
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


@pytest.mark.processes
def test_one_mac_alone_streams_its_local_stores_without_a_worker_or_secret(
    sharded, tiny_checkpoint, tmp_path
):
    run = shoal("generate", "--model", str(sharded), "--local-store", str(sharded / "worker-0"),
                "--local-store", str(sharded / "worker-1"), "--memory-budget", "25%",
                "--secret-file", str(tmp_path / "no-secret"), "--max-tokens", "10",
                "--json", "--stats", "hello world")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    expected = mlx_lm_tokens(tiny_checkpoint("mixtral"), report["prompt_token_ids"], 10)
    assert report["token_ids"] == expected
    local = report["stats"]["streaming"]["workers"]["local"]
    assert local["bytes_read"] > 0 and len(local["drives"]) == 2
    assert "memory budget" in run.stdout + run.stderr


@pytest.mark.processes
def test_local_store_mistakes_are_refused_before_loading(sharded, tiny_checkpoint, tmp_path):
    run = shoal("generate", "--model", str(sharded), "--memory-budget", "25%", "hi")
    assert run.returncode == 2 and "give --local-store DIR too" in run.stderr
    run = shoal("generate", "--model", str(sharded), "--local-store", str(sharded / "worker-0"),
                "--memory-budget", "lots", "hi")
    assert run.returncode == 2 and "is not a size like 512M" in run.stderr
    run = shoal("generate", "--model", str(sharded), "--local-store", str(tmp_path), "hi")
    assert run.returncode == 2 and "holds no manifest.json" in run.stderr
    run = shoal("generate", "--model", str(sharded), "--local-store", str(tmp_path / "nope"),
                "hi")
    assert run.returncode == 2 and f"--local-store: {tmp_path / 'nope'} does not exist" in \
        run.stderr
    other = tmp_path / "other"
    shard(tiny_checkpoint("qwen3_moe"), other, progress=False)
    run = shoal("generate", "--model", str(sharded), "--local-store", str(other / "experts"),
                "hi")
    assert run.returncode == 2 and "holds another model" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.processes
@pytest.mark.slow
def test_generate_with_one_local_store_and_one_worker_matches_mlx_lm(
    sharded, tiny_checkpoint, start_worker, secret_file
):
    worker = start_worker([sharded / "worker-1"], "--memory-budget", "10%")
    run = shoal("generate", "--model", str(sharded), "--local-store", str(sharded / "worker-0"),
                "--memory-budget", "10%", "--workers", worker.address,
                "--secret-file", str(secret_file), "--max-tokens", "10", "--json", "--stats",
                "hello world")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    expected = mlx_lm_tokens(tiny_checkpoint("mixtral"), report["prompt_token_ids"], 10)
    assert report["token_ids"] == expected
    assert set(report["stats"]["streaming"]["workers"]) == {"local", worker.address}
    # the coordinator is one more member for the heat and the rebalance's plan
    members = ("--local-store", str(sharded / "worker-0"), "--workers", worker.address,
               "--secret-file", str(secret_file))
    run = shoal("rebalance", "--model", str(sharded), *members, "--dry-run", "--json")
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert len(plan["workers"]) == 2, plan["workers"]
    run = shoal("heat", "--model", str(sharded), *members, "--json")
    assert run.returncode == 0 and json.loads(run.stdout), run.stderr


@pytest.mark.processes
def test_heat_of_one_mac_alone_needs_no_worker_or_secret(sharded, tmp_path):
    stores = ("--local-store", str(sharded / "worker-0"), "--local-store",
              str(sharded / "worker-1"))
    run = shoal("generate", "--model", str(sharded), *stores, "--max-tokens", "4",
                "--secret-file", str(tmp_path / "none"), "hello")
    assert run.returncode == 0, run.stderr
    run = shoal("heat", "--model", str(sharded), *stores, "--secret-file",
                str(tmp_path / "none"), "--json")
    assert run.returncode == 0, run.stderr
    heat = json.loads(run.stdout)  # layer -> expert -> tokens, counted by the coordinator
    assert sum(sum(experts.values()) for experts in heat.values()) > 0, heat


@pytest.mark.processes
@pytest.mark.slow
def test_a_cluster_config_names_the_coordinators_own_store_beside_its_worker(
    sharded, tiny_checkpoint, start_worker, secret_file, tmp_path
):
    worker = start_worker([sharded / "worker-1"], "--no-advertise")
    config = tmp_path / "desk.toml"
    config.write_text(f'name = "desk"\n[coordinator]\nstores = ["{sharded / "worker-0"}"]\n'
                      f'memory_budget = "10%"\n[[workers]]\naddress = "{worker.address}"\n')
    run = shoal("generate", "--model", str(sharded), "--cluster-config", str(config),
                "--secret-file", str(secret_file), "--max-tokens", "10", "--json", "--stats",
                "hello world")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    expected = mlx_lm_tokens(tiny_checkpoint("mixtral"), report["prompt_token_ids"], 10)
    assert report["token_ids"] == expected
    local = report["stats"]["streaming"]["workers"]["local"]
    assert local["memory_budget"] < local["expert_bytes"]  # the config's 10%
    assert set(report["stats"]["streaming"]["workers"]) == {"local", worker.address}


@pytest.mark.processes
def test_a_misspelt_option_or_command_is_named_with_the_near_one():
    run = shoal("generate", "--modle", "out", "hi")
    assert run.returncode == 2 and "unknown option --modle; did you mean --model?" in run.stderr
    assert "required" not in run.stderr
    run = shoal("genrate")
    assert run.returncode == 2 and "did you mean 'generate'?" in run.stderr
    run = shoal("--stroe", "x", module="worker.daemon")
    assert run.returncode == 2 and "unknown option --stroe; did you mean --store?" in run.stderr


@pytest.mark.processes
def test_a_bare_shoal_lists_the_commands():
    run = shoal()
    assert run.returncode == 0, run.stderr
    assert all(name in run.stdout for name in ("generate", "serve", "chat", "doctor"))


@pytest.mark.processes
def test_a_folder_that_does_not_exist_is_said_so(tmp_path):
    nope = str(tmp_path / "nope")
    run = shoal("--store", nope, "--secret-file", nope, module="worker.daemon")
    assert run.returncode == 2 and f"{nope} does not exist" in run.stderr, run.stderr
    run = shoal("generate", "--model", nope, "hi")
    assert run.returncode == 2 and f"--model {nope} does not exist" in run.stderr
