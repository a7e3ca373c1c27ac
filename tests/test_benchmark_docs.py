"""docs/benchmarks.md's figures are rendered from the result records in docs/measurements/:
the page is what the records render, and a figure without its record fails."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.figures import DOC, MissingFigure, newest, render
from benchmarks.records import (
    BENCH_BASELINES,
    BENCH_FIGURES,
    RESULTS,
    device_label,
    from_variants,
    load,
    value,
    write_record,
)
from benchmarks.scale_figures import DOC as STREAMING_DOC
from benchmarks.scale_figures import render_scale

REPO = Path(__file__).resolve().parents[1]
H200_BENCH = "h200-bench-"  # every `shoal bench` record of the H200 machine


def test_the_page_is_what_the_records_render():
    text = DOC.read_text()
    assert render(text, newest(RESULTS)) == text, "run `shoal bench --report` and commit"


def test_the_streaming_pages_scaling_tables_are_what_the_newest_scale_record_renders():
    text = STREAMING_DOC.read_text()
    assert "<!-- rendered: scale" in text
    assert render_scale(text, RESULTS) == text, "run python -m benchmarks.scale_figures"


def test_the_page_stays_a_reference_of_at_most_400_lines():
    assert len(DOC.read_text().splitlines()) <= 400


def test_a_figure_whose_record_is_missing_fails(tmp_path):
    for path in RESULTS.iterdir():
        if not path.name.startswith(H200_BENCH):
            shutil.copy(path, tmp_path)
    with pytest.raises(MissingFigure, match="'bench' on 'h200'"):
        render(DOC.read_text(), newest(tmp_path))


def test_every_report_kept_is_cited_by_a_doc():
    docs = [*REPO.glob("docs/*.md"), REPO / "README.md", REPO / "benchmarks/probes/README.md"]
    cited = "\n".join(p.read_text() for p in docs)
    for path in RESULTS.iterdir():
        if path.name != "README.md":
            assert path.name in cited, f"{path.name} backs no figure: delete it (git keeps it)"


def test_a_bench_report_printed_before_records_renders_as_a_record(tmp_path):
    """The shape `shoal bench --json` printed before records: its sections at the top level."""
    record = load(newest(RESULTS)[("h200", "bench")][0])
    old = {"machine": {k: v for k, v in record["machine"].items() if k != "label"},
           **record["figures"], **record["baselines"], **record["ratios"],
           "settings": record["settings"], "layer_overhead_ms": record["layer_overhead_ms"]}
    assert set(BENCH_FIGURES) | set(BENCH_BASELINES) <= set(old)
    report = tmp_path / "report.json"
    report.write_text(json.dumps(old))
    folder = tmp_path / "results"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.records", str(report), "--machine", "h200",
         "--commit", "abc1234", "--recorded", "2099-01-01T00:00:00+00:00"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, "SHOAL_RESULTS": str(folder)})
    assert run.returncode == 0, run.stderr
    for path in RESULTS.iterdir():
        if not path.name.startswith(H200_BENCH):
            shutil.copy(path, folder)
    records = newest(folder)
    path, made = records[("h200", "bench")]
    assert path.parent == folder and made["commit"] == "abc1234"
    key = "figures.shoal.decode_tps"
    assert value(made, key) == value(record, key)
    assert "at abc1234" in render(DOC.read_text(), records)


def test_a_machine_is_named_by_its_device():
    assert device_label("NVIDIA H200") == "h200"
    assert device_label("Apple M3 Ultra") == "m3-ultra"
    assert device_label("Intel(R) Xeon(R) Processor", gpu=False) == "cpu"
    assert device_label("", gpu=True) == "gpu"


def test_a_benchmark_writes_one_record_with_one_call(tmp_path, monkeypatch):
    monkeypatch.setenv("SHOAL_RESULTS", str(tmp_path))
    report = {"results": {"plain": {"decode_tps": 10.0}}, "size": "tiny", "machine": {}}
    path = write_record(what="sync-floor-quick", figures=report["results"], **report)
    record = load(path)
    assert path.parent == tmp_path and path.name.startswith("cpu-sync-floor-quick-")
    assert value(record, "figures.plain.decode_tps") == 10.0
    assert record["size"] == "tiny" and "results" not in record  # not stored twice
    assert record["machine"]["label"] == "cpu" and record["commit"]
    assert newest(tmp_path)[("cpu", "sync-floor-quick")][0] == path


def test_variants_lines_become_figures_against_baselines():
    lines = [{"variant": "lane", "tok_s": 32.3, "breakdown": {"wire_us": 554}},
             {"variant": "grpc", "tok_s": 26.0, "breakdown": {"wire_us": 1138}},
             {"variant": "lane", "tok_s": 34.2, "breakdown": {"wire_us": 460}}]
    figures, baselines = from_variants(lines)
    assert figures == {"lane": {"tok_s": [32.3, 34.2], "wire_us": [554, 460]}}
    assert baselines == {"grpc": {"tok_s": [26.0], "wire_us": [1138]}}
