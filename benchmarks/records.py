"""Result records: one JSON file per benchmark run (what, command, commit, machine, figures,
baselines, ratios), written to the results folder that docs/benchmarks.md is rendered from."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "measurements"
RESULTS_ENV = "SHOAL_RESULTS"  # another folder (tests, scratch runs)
MACHINE_ENV = "SHOAL_MACHINE"  # a short name for this machine in place of the derived one
KEYS = ("what", "command", "commit", "recorded", "machine", "figures", "baselines", "ratios")
# the sections of a `shoal bench` report: Shoal's configurations, then what they are held to
BENCH_FIGURES = ("shoal", "shoal_one_mac_all_local", "shoal_one_local_one_remote")
BENCH_BASELINES = ("mlx_lm_single", "mlx_lm_tensor_parallel", "mlx_lm_pipeline_parallel")


def results_folder() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


def machine() -> dict:
    """This machine as a record names it; `label` (cpu, h200, m3-ultra...) is the name the
    docs' tables choose records by."""
    import mlx.core as mx

    gpu = mx.default_device().type == mx.gpu
    name = str(mx.device_info().get("device_name", "")) if gpu else ""
    label = os.environ.get(MACHINE_ENV) or device_label(name, gpu=gpu)
    return {"label": label, "device": name or ("gpu" if gpu else "cpu"),
            "platform": platform.platform(),
            "processor": platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mlx": mx.__version__}


def device_label(device_name: str, *, gpu: bool = True) -> str:
    """"NVIDIA H200" -> "h200", "Apple M3 Ultra" -> "m3-ultra"; no GPU -> "cpu"."""
    if not gpu:
        return "cpu"
    words = re.sub(r"[^a-z0-9 ]", "", device_name.lower()).split()
    if words and words[0] in ("nvidia", "apple", "amd"):
        words = words[1:]
    return "-".join(words) or "gpu"


def commit() -> str:
    """The checkout's commit, marked when tracked files differ from it."""
    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=30)
        return run.stdout.strip() if run.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def make_record(*, what: str, command: str, figures: dict, baselines: dict | None = None,
                ratios: dict | None = None, **details: object) -> dict:
    return {"what": what, "command": command, "commit": commit(),
            "recorded": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
            "figures": figures, "baselines": baselines or {}, "ratios": ratios or {},
            **details}


def write_record(*, what: str, figures: dict, baselines: dict | None = None,
                 ratios: dict | None = None, command: str | None = None,
                 **details: object) -> Path:
    """The one call a benchmark makes: its run's record, written as <machine>-<what>-<time>.json
    to the results folder (the command defaults to this process's own command line)."""
    details.pop("machine", None)  # the record's own names this machine
    # a report passed whole beside its figures: not stored twice
    details = {k: v for k, v in details.items() if v is not figures and v is not baselines}
    record = make_record(what=what, command=command or command_line(), figures=figures,
                         baselines=baselines, ratios=ratios, **details)
    return save(record)


def save(record: dict, folder: Path | None = None) -> Path:
    folder = folder or results_folder()
    folder.mkdir(parents=True, exist_ok=True)
    stamp = record["recorded"].replace(":", "").replace("-", "")[:13]
    path = folder / f"{record['machine']['label']}-{record['what']}-{stamp}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {path}", file=sys.stderr, flush=True)
    return path


def command_line() -> str:
    """How this process was started, as a reader would type it again."""
    program = Path(sys.argv[0]).resolve()
    if program.name == "shoal" or program.parent == REPO / "coordinator" / "cli":
        head = "shoal"
    elif program.is_relative_to(REPO) and program.suffix == ".py":
        head = "python -m " + ".".join(program.relative_to(REPO).with_suffix("").parts)
    else:
        head = sys.argv[0]
    return " ".join([head, *sys.argv[1:]])


def from_bench(report: dict, *, what: str = "bench", command: str = "shoal bench --json",
               commit_: str = "unknown", recorded: str = "", label: str = "") -> dict:
    """A record from a `shoal bench --json` report as it was printed before records (its
    sections at the top level); a record is returned as it is."""
    if "figures" in report:
        return report
    machine_ = dict(report.get("machine", {}))
    machine_.setdefault("label", label or "unknown")
    return {"what": what, "command": command, "commit": commit_, "recorded": recorded,
            "machine": machine_,
            "figures": {k: report[k] for k in BENCH_FIGURES if k in report},
            "baselines": {k: report[k] for k in BENCH_BASELINES if k in report},
            "ratios": {k: v for k, v in report.items() if "_ratio_" in k},
            **{k: report[k] for k in ("checkpoint", "settings", "layer_overhead_ms")
               if k in report}}


def from_variants(results: list[dict]) -> tuple[dict, dict]:
    """`benchmarks.variants`' RESULT lines as (figures, baselines): the first variant's label is
    the one under test, the others its baselines; each figure a list, one value per round."""
    by_label: dict[str, dict[str, list[float]]] = {}
    for result in results:
        row = by_label.setdefault(result["variant"], {})
        figures = {"tok_s": result["tok_s"], **result.get("breakdown", {}),
                   **{k: v for k, v in result.items() if k.startswith("prefill") and
                      isinstance(v, int | float)}}
        for name, figure in figures.items():
            row.setdefault(name, []).append(figure)
    first, *others = by_label
    return {first: by_label[first]}, {label: by_label[label] for label in others}


def load(path: Path) -> dict:
    record = from_bench(json.loads(path.read_text()))
    missing = [k for k in KEYS if k not in record]
    if missing:
        raise ValueError(f"{path.name} is not a result record: no {', '.join(missing)}")
    return record


def value(record: dict, key: str) -> float:
    """A figure by its dotted path in the record, e.g. "figures.shoal.decode_tps"."""
    node: object = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(key)
        node = node[part]
    if not isinstance(node, int | float):
        raise KeyError(key)
    return float(node)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.records",
        description="Make a result record from a `shoal bench --json` report printed without "
                    "one (what, commit and machine given here) and write it to the results "
                    "folder")
    parser.add_argument("report", type=Path, help="the JSON report")
    parser.add_argument("--machine", required=True, help="the machine's label (h200, cpu...)")
    parser.add_argument("--commit", required=True, help="the commit the run measured")
    parser.add_argument("--what", default="bench", help="what ran (default bench)")
    parser.add_argument("--command", default="shoal bench --json", help="the command it ran")
    parser.add_argument("--recorded", default=datetime.now(UTC).isoformat(timespec="seconds"),
                        help="when it ran, ISO 8601 (default now)")
    args = parser.parse_args()
    record = from_bench(json.loads(args.report.read_text()), what=args.what,
                        command=args.command, commit_=args.commit, recorded=args.recorded,
                        label=args.machine)
    record["machine"]["label"] = args.machine
    save(record)


if __name__ == "__main__":
    main()
