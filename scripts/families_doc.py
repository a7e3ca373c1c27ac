"""Run the family sweep and write its results into docs/models.md between the markers
`<!-- families:begin -->` and `<!-- families:end -->`: `python scripts/families_doc.py`,
or `--report F` to write from an earlier sweep's JSON lines."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from builders.families import TINY, discover
from builders.synthetic import random_model
from builders.synthetic_config import model_config
from engine.experts import switch_widths
from engine.moe_layers import SWITCH_CLASSES

ROOT = Path(__file__).resolve().parents[1]

DOC = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
SWEEP = "tests/integration/test_families.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path,
                        help="JSON lines written by an earlier sweep (SHOAL_FAMILIES_REPORT); "
                             "without it the sweep runs now (a few minutes)")
    parser.add_argument("--doc", type=Path, default=DOC, help=f"the file to write ({DOC})")
    args = parser.parse_args(argv)
    if args.report is not None and not args.report.is_file():
        parser.error(f"{args.report} is not a file")
    seconds = None
    if args.report is None:
        report, seconds = run_sweep()
    else:
        report = args.report
    results = read_report(report.read_text())
    write_section(args.doc, render(results, seconds))
    failed = [f"{family} ({bits or 'f32'})" for (family, bits), (outcome, _) in results.items()
              if outcome.startswith("fails")]
    print(f"wrote {len(results)} results to {args.doc}" +
          (f"; failing: {', '.join(failed)}" if failed else ""))
    return 0


def run_sweep() -> tuple[Path, float]:
    report = Path(tempfile.mkdtemp(prefix="shoal-families-")) / "report.jsonl"
    env = {**os.environ, "SHOAL_FAMILIES_REPORT": str(report), "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    # A failing family is a result to write down, so the sweep's exit status is not ours.
    # -n 0: one case at a time (not the suite's xdist workers), so each case's seconds are its own.
    subprocess.run([sys.executable, "-m", "pytest", SWEEP, "-q", "-n", "0",
                    "-p", "no:cacheprovider"],
                   cwd=ROOT, env=env, check=False)
    return report, time.monotonic() - started


def read_report(text: str) -> dict[tuple[str, int | None], tuple[str, float]]:
    """(family, bits) -> (outcome, seconds); a later line for the same case wins."""
    results = {}
    for line in text.splitlines():
        if line.strip():
            case = json.loads(line)
            results[(case["family"], case["bits"])] = (case["outcome"], case["seconds"])
    return results


def render(results: dict[tuple[str, int | None], tuple[str, float]], seconds: float | None) -> str:
    rows = ["| Family | Experts kept as | float32 | 4-bit | Notes |", "|---|---|---|---|---|"]
    for family in discover():
        tiny = TINY.get(family)
        f32 = _cell(results.get((family, None)))
        q4 = _cell(results.get((family, 4))) if tiny is not None and tiny.quantized else "-"
        rows.append(f"| `{family}` | {_seam(family)} | {f32} | {q4} | {_note(family)} |")
    if seconds is None:
        seconds = sum(case_seconds for _, case_seconds in results.values())
    summary = (f"Swept against mlx-lm {version('mlx-lm')}: {len(results)} cases in "
               f"{seconds / 60:.1f} min on a 2-core CPU; regenerate with "
               "`PYTHONPATH=. python scripts/families_doc.py`.")
    return "\n".join([summary, "", *rows])


def _seam(family: str) -> str:
    """Where the family's MoE block keeps its switch module, and its input width if that is
    not the model's (experts in a latent space)."""
    if family not in TINY:
        return ""
    config = model_config(family)
    model = random_model(config, seed=0)
    path, module = next((p, m) for p, m in model.named_modules()
                        if isinstance(m, SWITCH_CLASSES))
    where = re.sub(r"^.*?\b(?:layers|h)\.\d+\.", "", path)
    width = switch_widths(module)[0]
    hidden = (config.get("text_config") or config).get("hidden_size")
    latent = f", {width} wide in a {hidden}-wide model" if hidden and width != hidden else ""
    return f"`{where}` ({type(module).__name__}{latent})"


def _cell(result: tuple[str, float] | None) -> str:
    if result is None:
        return "not run"
    outcome = result[0]
    if outcome == "exact":
        return "exact"
    if outcome.startswith("served, no reference"):
        return "sharded and served; no reference here"
    return outcome.replace("|", "\\|")


def _note(family: str) -> str:
    tiny = TINY.get(family)
    if tiny is None:
        return "no tiny config yet (builders/families.py)"
    notes = []
    if tiny.needs_metal:
        notes.append(f"needs Metal: {tiny.needs_metal}")
    if tiny.packed:
        bits, group = tiny.packed
        notes.append(f"exists only {bits}-bit (groups of {group}); its float32 column is that")
    if tiny.nested:
        notes.append("config nests the model under `text_config`")
    return "; ".join(notes)


def write_section(doc: Path, body: str) -> None:
    text = doc.read_text() if doc.exists() else ""
    section = f"{BEGIN}\n{body}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + section + "\n"
    doc.write_text(text)


if __name__ == "__main__":
    sys.exit(main())
