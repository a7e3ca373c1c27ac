"""`python -m benchmarks.streaming --scale 1,2 --quick` runs end to end on a tiny checkpoint: each
member in its own cgroup, the JSON a reader and the docs take, greedy ids equal to mlx-lm's
(two members with each cold expert on both drives).
It guards the harness, not the speed (speed is for the benchmark's own run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.stream_limits import cgroups_available

REPO = Path(__file__).resolve().parents[2]
ROW_FIELDS = {"members", "tok_s", "ideal_x", "hit_rate", "read_bytes_per_token",
              "demand_bytes_per_token", "drive_busy", "cpu_busy", "forecast_tok_s", "exact"}
RUN_FIELDS = {"drive_mbps", "memory_budget", "cpu_share", "rows", "mixed_drives", "load_after"}


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.skipif(cgroups_available() is not None,
                    reason=f"the benchmark's members need cgroups: {cgroups_available()}")
@pytest.mark.long
def test_the_scaling_benchmark_runs_two_members_in_their_limits_exactly(tiny_checkpoint,
                                                                         tmp_path):
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.streaming", "--scale", "1,2", "--quick",
         "--checkpoint", str(tiny_checkpoint("qwen3_moe")), "--tokens", "4",
         "--drive-mbps", "8", "--mixed-drives", "8,16", "--drive-copies", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "SHOAL_CACHE": str(tmp_path / "cache"),
             "SHOAL_RESULTS": str(tmp_path / "results")})
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert RUN_FIELDS <= set(report)
    assert (report["drive_mbps"], report["cpu_share"]) == (8.0, 0.4)
    rows = [*report["rows"], report["mixed_drives"]]
    assert [row["members"] for row in rows] == [1, 2, 2]
    for row in rows:
        assert ROW_FIELDS <= set(row), ROW_FIELDS - set(row)
        assert row["exact"] is True, "greedy ids differ from mlx-lm's"
        assert row["tok_s"] > 0 and row["forecast_tok_s"] > 0
        assert len(row["drive_busy"]) == len(row["cpu_busy"]) == row["members"]
        assert all(c is not None and c >= 0 for c in row["cpu_busy"])
    assert [row["ideal_x"] for row in rows] == [1.0, 2.0, 3.0]
    # two members: each cold expert on both drives, more bytes stored than the one copy
    assert [row["drive_copies"] for row in rows] == [1, 2, 2]
    assert rows[1]["stored_bytes"] > rows[0]["stored_bytes"]
    # every limit the benchmark means to set was set: memory, read rate and CPU share
    assert not any(row["not_set"] for row in rows), rows[0]["not_set"]
    controls = {kind.split()[-1].split(".")[0] for kind in rows[0]["limits"]}
    assert {"memory", "cpu"} <= controls and controls & {"blkio", "io"}, controls
    assert "members" in run.stdout and "load average" in run.stdout
    assert len(list((tmp_path / "results").glob("*.json"))) == 1
