import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.checkpoint import shard

REPO = Path(__file__).resolve().parents[2]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "coordinator.cli", "plan", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


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
    assert run.returncode == 0, run.stderr
    assert "does not fit: the cluster cannot hold the model" in run.stdout


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
