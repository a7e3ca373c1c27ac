import json

import pytest

from engine.sharding import shard
from tests.coordinator.cli.test_plan_command import plan


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan-streaming") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    return out


def test_plan_forecasts_streamed_decode_on_one_two_and_four_macs(sharded):
    first = json.loads(plan("--model", str(sharded), "--worker", "a=1G", "--json").stdout)
    quarter = first["model"]["expert_bytes"] // 4
    macs = [arg for name in "abcd" for arg in ("--worker", f"{name}={quarter // 2}:1G")]
    run = plan("--model", str(sharded), *macs, "--disk-gbps", "0.0001", "--scaling", "--json")
    assert run.returncode == 3, run.stderr  # four eighths: streams even on all four
    rows = json.loads(run.stdout)["streaming"]["rows"]
    assert [row["macs"] for row in rows] == [1, 2, 4]
    speeds = [row["tokens_per_second"] for row in rows]
    assert speeds[0] < speeds[1] < speeds[2]
    assert rows[0]["hit_rate"] < rows[1]["hit_rate"] < rows[2]["hit_rate"]
    text = plan("--model", str(sharded), *macs, "--scaling").stdout
    assert "streaming forecast (heat assumed, skew 0" in text
    assert "4 Mac(s): ~" in text


def test_a_plan_that_fits_in_memory_forecasts_only_when_asked(sharded):
    run = plan("--model", str(sharded), "--worker", "a=1G", "--json")
    assert "streaming" not in json.loads(run.stdout)
    run = plan("--model", str(sharded), "--worker", "a=1G", "--scaling", "--json")
    (row,) = json.loads(run.stdout)["streaming"]["rows"]
    assert row["resident"] and row["hit_rate"] == 1.0 and row["read_bytes_per_token"] == 0
