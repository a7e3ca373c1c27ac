import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.cli.shoal_command import main
from engine.sharding import shard

REPO = Path(__file__).resolve().parents[3]


def plan(*args: str) -> subprocess.CompletedProcess:
    """`shoal plan ARGS` in this process (the command's own main, its exit status and output)."""
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(["plan", *args])
        except SystemExit as e:
            code = e.code
    return subprocess.CompletedProcess(["shoal", "plan", *args], code, out.getvalue(),
                                       err.getvalue())


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    return out


def test_plan_replicates_hot_experts_from_a_heat_file(sharded, tmp_path):
    heat = {str(layer): {str(e): 1000 if e == 0 else 10 for e in range(8)} for layer in range(3)}
    heat_file = tmp_path / "heat.json"
    heat_file.write_text(json.dumps(heat))
    run = plan("--model", str(sharded), "--worker", "a=1G", "--worker", "b=1G",
               "--heat", str(heat_file), "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["fits"] and report["resident"]
    assert {"0/0", "1/0", "2/0"} <= set(report["replicas"])
    assert report["imbalance_after"] < report["imbalance_before"]
    assert report["decode_bound"]["tokens_per_second"] > 0
    assert sum(w["experts"] for w in report["workers"].values()) == 24 + len(report["replicas"])


def test_plan_says_when_the_model_does_not_fit(sharded):
    run = plan("--model", str(sharded), "--worker", "a=10K:20K", "--worker", "b=10K:20K")
    assert run.returncode == 4, run.stderr
    assert "does not fit: the cluster cannot hold the model" in run.stdout


def test_plan_exit_status_tells_fits_streams_and_does_not_fit(tmp_path):
    # The real DeepSeek-V3 config (FP8 source, held as bf16 unless quantized): 1239 GiB of
    # experts, its MTP module's included; at 4 bits 349 GiB.
    from tests.engine.published_configs import DEEPSEEK_V3

    config = tmp_path / "config.json"
    config.write_text(json.dumps(DEEPSEEK_V3))
    two_studios = ["--worker", "a=192G:2T", "--worker", "b=192G:2T"]
    as_is = plan("--model", str(config), *two_studios)
    assert as_is.returncode == 3, as_is.stderr
    assert "1239.0 GiB of experts" in as_is.stdout and "only by streaming" in as_is.stdout
    assert "FP8" in as_is.stdout
    bigger_studios = ["--worker", "a=256G:2T", "--worker", "b=256G:2T"]
    four_bits = plan("--model", str(config), *bigger_studios, "--bits", "4", "--json")
    assert four_bits.returncode == 0, four_bits.stderr
    report = json.loads(four_bits.stdout)
    assert report["verdict"] == "fits" and report["model"]["expert_bits_per_weight"] == 4.5
    small = plan("--model", str(config), "--worker", "a=64G:100G", "--bits", "4")
    assert small.returncode == 4 and "does not fit" in small.stdout
    bad = plan("--model", str(config), "--worker", "a=64G", "--bits", "7")
    assert bad.returncode == 2 and "--bits takes" in bad.stderr


def test_plan_refuses_bits_for_a_sharded_folder(sharded):
    run = plan("--model", str(sharded), "--worker", "a=1G", "--bits", "4")
    assert run.returncode == 2 and "already sharded" in run.stderr


def test_plan_reads_a_shoal_manifest_given_as_a_file_as_its_folder(sharded):
    folder = json.loads(plan("--model", str(sharded), "--worker", "a=8G:10G", "--json").stdout)
    for manifest in (sharded / "manifest.json", sharded / "experts" / "manifest.json"):
        run = plan("--model", str(manifest), "--worker", "a=8G:10G", "--json")
        assert run.returncode == 0, run.stderr
        model = json.loads(run.stdout)["model"]
        assert model == folder["model"] and not model["estimated_from_config"]


def test_a_config_that_is_not_a_model_config_gets_an_error_that_names_it(tmp_path):
    for body, words in (("{}", "names no model_type"), ("[1]", "names no model_type"),
                        ('{"model_type": "qwen3_moe"}', "lacks what mlx-lm's qwen3_moe needs")):
        config = tmp_path / "config.json"
        config.write_text(body)
        run = plan("--model", str(config), "--worker", "a=8G:10G")
        assert run.returncode == 2 and words in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_plan_estimates_from_a_config_and_refuses_bad_input(tiny_checkpoint, tmp_path):
    config = tiny_checkpoint("mixtral") / "config.json"
    run = plan("--model", str(config), "--worker", "a=1G", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["model"]["estimated_from_config"]
    bad = plan("--model", str(config), "--worker", "a=lots")
    assert bad.returncode == 2 and "sizes look like" in bad.stderr
    (tmp_path / "heat.json").write_text('{"0": {"99": 5}}')
    bad = plan("--model", str(config), "--worker", "a=1G", "--heat", str(tmp_path / "heat.json"))
    assert bad.returncode == 2 and "does not have" in bad.stderr


def deepseek_config(tmp_path) -> Path:
    from tests.engine.published_configs import DEEPSEEK_V3

    config = tmp_path / "config.json"
    config.write_text(json.dumps(DEEPSEEK_V3))
    return config


def test_plan_gives_an_fp8_sources_download_size_beside_its_split(tmp_path):
    config = deepseek_config(tmp_path)
    run = plan("--model", str(config), "--worker", "a=192G:2TB", "--json")
    model = json.loads(run.stdout)["model"]
    # About one byte per weight (671 billion and the MTP module's 14, as published: `shoal
    # shard` keeps it), and the bf16 split about twice that.
    assert 640e9 < model["source_bytes"] < 700e9
    assert 1.9 < model["split_bytes"] / model["source_bytes"] < 2.1
    text = plan("--model", str(config), "--worker", "a=192G:2TB").stdout
    assert "download: 684." in text and "GB = " in text and "GiB (estimated" in text
    assert "the split `shoal shard` writes: 1.37 TB = 1.24 TiB" in text
    quantized = plan("--model", str(config), "--worker", "a=192G:2TB", "--bits", "4", "--json")
    model_q = json.loads(quantized.stdout)["model"]
    assert model_q["source_bytes"] == model["source_bytes"]  # the download is the same


def test_plan_reads_decimal_tb_as_drives_are_sold_and_prints_both(sharded):
    run = plan("--model", str(sharded), "--worker", "a=300M:2TB", "--worker", "b=1G:2T",
               "--json")
    workers = json.loads(run.stdout)["workers"]
    assert workers["a"]["disk"] == 2 * 10**12 and workers["b"]["disk"] == 2 * 2**40
    assert workers["a"]["memory"] == 300 * 2**20
    text = plan("--model", str(sharded), "--worker", "a=300M:2TB", "--worker", "b=1G:2T").stdout
    assert "2.00 TB = 1.82 TiB" in text and "2.20 TB = 2.00 TiB" in text
    assert "300.0 MiB" in text and " 0G " not in text


@pytest.mark.processes
def test_every_command_keeps_its_exit_status_when_its_reader_goes_away(tmp_path):
    """`shoal plan ... | head`: the pipe closes before the output is written."""
    config = deepseek_config(tmp_path)
    commands = [(["plan", "--model", str(config), "--worker", "a=192G:2T", "--json"], 3),
                (["doctor", "--no-mdns", "--secret-file", str(tmp_path / "none")], 1),
                (["plan", "--help"], 0)]
    for args, status in commands:
        proc = subprocess.Popen([sys.executable, "-m", "coordinator.cli", *args],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
        proc.stdout.close()  # as `head` does once it has its lines
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
        assert proc.returncode == status, (args, err.decode())
        assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_plan_of_a_sharded_folder_uses_the_heat_its_cluster_recorded(sharded):
    from coordinator.ops.heat_record import Reading, record_heat, reset_heat
    from engine.manifest import read_manifest

    manifest = read_manifest(sharded)
    hot = {(layer, expert): 1000 if expert == 0 else 10 for layer in range(3)
           for expert in range(8)}
    record_heat(sharded, manifest, [Reading("a", "boot-1", hot)])
    try:
        run = plan("--model", str(sharded), "--worker", "a=1G", "--worker", "b=1G", "--json")
        report = json.loads(run.stdout)
        assert report["heat"].startswith(f"recorded in {sharded / 'heat.msgpack'}")
        assert {"0/0", "1/0", "2/0"} <= set(report["replicas"])
        uniform = json.loads(plan("--model", str(sharded), "--worker", "a=1G", "--worker", "b=1G",
                                  "--json", "--uniform").stdout)
        assert uniform["heat"] == "uniform" and not uniform["replicas"]
    finally:
        reset_heat(sharded)


def published_config(tmp_path: Path, name: str) -> Path:
    from tests.engine.published_configs import PUBLISHED

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(PUBLISHED[name][0]))
    return path


def test_a_bf16_model_that_does_not_fit_gets_the_bits_that_would_and_a_disk_question(
    tmp_path
):
    config = published_config(tmp_path, "Mixtral-8x7B")
    run = plan("--model", str(config), "--worker", "a=32G", "--worker", "b=32G")
    assert run.returncode == 3, run.stdout  # only by streaming
    hints = [line for line in run.stdout.splitlines() if line.startswith("hint: ")]
    assert hints[0].startswith("hint: with --bits 8 (`shoal shard --quantize 8`) it would fit")
    assert "NAME=MEMORY:DISK" in hints[1]
    quantized = plan("--model", str(config), "--worker", "a=32G", "--worker", "b=32G",
                     "--bits", "8")
    assert quantized.returncode == 0, quantized.stdout  # the hint holds
    given_disks = plan("--model", str(config), "--worker", "a=16G:1TB", "--worker",
                       "b=16G:1TB", "--json")
    advice = json.loads(given_disks.stdout)["advice"]
    assert advice and not any("DISK" in line for line in advice)  # disks given: not asked


def test_a_bf16_config_gets_its_download_size(tmp_path):
    config = published_config(tmp_path, "Qwen3-30B-A3B")
    report = json.loads(plan("--model", str(config), "--worker", "a=64G", "--worker",
                             "b=64G", "--json").stdout)
    model = report["model"]
    assert model["source_bytes"] == model["expert_bytes"] + model["dense_bytes"]
    assert report["verdict"] == "fits" and report["advice"] == []
    text = plan("--model", str(config), "--worker", "a=64G", "--bits", "4").stdout
    assert f"download: {model['source_bytes'] / 1e9:.2f} GB" in text  # bf16's, not the 4-bit
