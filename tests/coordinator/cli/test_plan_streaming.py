import json
import re

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
    assert "4 machines: ~" in text and "Mac(s)" not in text  # this suite runs on Linux


def test_a_plan_that_fits_in_memory_forecasts_only_when_asked(sharded):
    run = plan("--model", str(sharded), "--worker", "a=1G", "--json")
    assert "streaming" not in json.loads(run.stdout)
    run = plan("--model", str(sharded), "--worker", "a=1G", "--scaling", "--json")
    (row,) = json.loads(run.stdout)["streaming"]["rows"]
    assert row["resident"] and row["hit_rate"] == 1.0 and row["read_bytes_per_token"] == 0


def test_no_forecast_exceeds_the_bound_printed_with_it(sharded):
    first = json.loads(plan("--model", str(sharded), "--worker", "a=1G", "--json").stdout)
    eighth = first["model"]["expert_bytes"] // 8
    macs = [arg for name in "ab" for arg in ("--worker", f"{name}={eighth}")]
    for extra in ((), ("--scaling",), ("--disk-gbps", "0.0001", "--scaling")):
        text = plan("--model", str(sharded), *macs, *extra).stdout
        pairs = re.findall(r"~([0-9.]+) tokens/s \(at most ~([0-9.]+)", text)
        assert pairs, text
        assert all(float(x) <= float(bound) for x, bound in pairs), text
        assert "decode at most" not in text  # no second model beside the forecast
        decode = re.search(r"^decode ~([0-9.]+) tokens/s", text, re.M)
        assert decode and f"2 machines: ~{decode.group(1)} tokens/s" in text, text


def test_a_sharded_folder_that_does_not_fit_gets_a_hint(sharded):
    run = plan("--model", str(sharded), "--worker", "a=10K:20K", "--worker", "b=10K:20K")
    assert run.returncode == 4
    assert "hint: streaming needs every expert on some worker's drive: add machines" in run.stdout
    assert "--quantize 4" in run.stdout  # a float32 split can be made smaller


def test_the_planned_members_are_called_what_the_platform_calls_them():
    from coordinator.ops.planning import machines

    assert machines(1, platform="darwin") == "1 Mac"
    assert machines(2, platform="darwin") == "2 Macs"
    assert machines(1, platform="linux") == "1 machine"
    assert machines(4, platform="linux") == "4 machines"


def test_plan_places_for_streaming_by_each_workers_read_speed(sharded):
    first = json.loads(plan("--model", str(sharded), "--worker", "a=1G", "--json").stdout)
    eighth = first["model"]["expert_bytes"] // 8
    run = plan("--model", str(sharded), "--worker", f"a={eighth}::40MB/s",
               "--worker", f"b={eighth}::80MB/s", "--json")
    assert run.returncode == 3, run.stderr
    report = json.loads(run.stdout)
    assert report["workers"]["b"]["bytes"] > 1.4 * report["workers"]["a"]["bytes"]
    (row,) = report["streaming"]["rows"]
    assert row["drive_busy"]["a"] == pytest.approx(row["drive_busy"]["b"], abs=0.15)
    bad = plan("--model", str(sharded), "--worker", "a=1G:1T:fast")
    assert bad.returncode == 2 and "not a read speed" in bad.stderr
