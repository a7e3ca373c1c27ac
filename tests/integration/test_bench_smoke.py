"""`shoal bench --quick` runs every system end to end and prints and writes its record.

It checks the harness, not the speed: speed is read from the printed figures (docs/benchmarks.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.records import load
from coordinator.decoding.report import BREAKDOWN_PARTS

REPO = Path(__file__).resolve().parents[2]
RATIOS = ("decode_ratio_vs_mlx_lm_single", "prefill512_ratio_vs_mlx_lm_single",
          "decode_ratio_vs_mlx_lm_tensor_parallel", "layer_overhead_ratio_vs_grpc_echo",
          "all_local_decode_ratio_vs_mlx_lm_single",
          "local_and_remote_decode_ratio_vs_two_remote")


@pytest.mark.slow
@pytest.mark.parametrize("network", [
    "loopback",  # the Thunderbolt-like cables take 10.213.0.0/16 on the host: one at a time
    pytest.param("thunderbolt", marks=pytest.mark.xdist_group("host-network"))])
@pytest.mark.long
def test_bench_quick_prints_a_complete_report(tmp_path, network):
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "bench", "--quick", "--json", "--network",
         network],
        capture_output=True, text=True, timeout=600, cwd=REPO,
        env={**os.environ, "SHOAL_CACHE": str(tmp_path / "cache"),
             "SHOAL_RESULTS": str(tmp_path / "results")},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    record = json.loads(run.stdout)
    # the printed record is the one written to the results folder, and a record the docs read
    written = list((tmp_path / "results").glob("*.json"))
    assert [load(p) for p in written] == [record]
    assert record["what"] == ("bench-quick" if network == "loopback" else
                              "bench-quick-thunderbolt")
    assert record["commit"] and record["machine"]["label"] == "cpu"
    report = {**record["figures"], **record["baselines"], **record["ratios"],
              "settings": record["settings"]}
    for key in RATIOS:
        assert key in report
    for system in ("shoal", "shoal_one_mac_all_local", "shoal_one_local_one_remote",
                   "mlx_lm_single", "mlx_lm_tensor_parallel", "mlx_lm_pipeline_parallel"):
        assert report[system].get("decode_tps", 0) > 0, (system, report[system])
        assert set(report[system]["prefill_tps"]) == {"16", "64"}
    dispatch = report["shoal"]["dispatch"]
    assert 1 <= dispatch["rpcs_per_token_per_layer"] <= 2  # one request per involved worker
    assert dispatch["prefill_requests_per_call"] >= 1  # pieces, for long enough prompts
    assert dispatch["bytes_sent_per_token"] > 0 and report["shoal"]["echo"]["round_trip_ms"] > 0
    assert report["shoal"]["echo"]["plaintext_ms"] > 0  # TLS's cost is measured beside it
    assert report["decode_ratio_vs_mlx_lm_single"] > 0
    breakdown = dispatch["breakdown"]
    assert set(breakdown) == {f"{part}_us" for part, _ in BREAKDOWN_PARTS}
    assert all(value >= 0 for value in breakdown.values()), breakdown
    assert breakdown["worker_matrix_us"] > 0 and breakdown["wire_us"] > 0
    # the critical worker's round trip (wire and its own parts) lies inside the call's
    inside = sum(breakdown[f"{p}_us"] for p in ("wire", "worker_parse", "worker_matrix",
                                                 "worker_bookkeeping", "worker_reads",
                                                 "worker_reply"))
    assert inside <= breakdown["round_trip_us"], breakdown
    assert breakdown["worker_reads_us"] == 0  # every expert resident: nothing waits on a drive
    assert report["layer_overhead_ratio_vs_grpc_echo"] > 0
    assert report["settings"]["network"] == network
    if network == "thunderbolt":  # the echo floor was measured over the same cables
        echo = report["shoal"]["echo"]
        assert echo["round_trip_ms"] >= 0.4 and echo["without_relay_ms"] > 0
