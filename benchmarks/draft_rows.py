"""What the draft benchmarks (draft_speedup.py, mtp_speedup.py) share: a run's figures, the
median run of several, and a report's rows as lines."""

from __future__ import annotations

import sys

from coordinator.decoding.generate import GenerationResult
from coordinator.decoding.report import speculative_report


def log(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def figures(result: GenerationResult, plain: GenerationResult | None) -> dict:
    row = {"decode_tps": result.decode_tps, "tokens": len(result.token_ids)}
    if result.speculative is not None:
        spec = speculative_report(result)
        row.update({key: spec[key] for key in (
            "proposed", "accepted", "acceptance_rate", "tokens_per_step", "verify_steps",
            "plain_steps")})
    if plain is not None:
        row["same_tokens"] = result.token_ids == plain.token_ids
    return row


def median_run(rows: list[dict]) -> dict:
    """The run with the median decode speed, with every run's speed beside it."""
    ordered = sorted(rows, key=lambda row: row["decode_tps"])
    middle = dict(ordered[len(ordered) // 2])
    middle["decode_tps_runs"] = [row["decode_tps"] for row in rows]
    middle["same_tokens"] = all(row.get("same_tokens", True) for row in rows)
    return middle


def result_lines(title: str, report: dict, first: str, width: int) -> list[str]:
    """A draft benchmark's report as lines: its settings, then a row per run (speed, against
    plain decoding, acceptance, tokens per step, whether the ids equal plain decoding's)."""
    settings = report["settings"]
    lines = [
        f"{title}, {settings['model']}, {settings['workers']} workers, "
        f"{settings['tokens']} tokens, median of {settings['runs']}, N <= "
        f"{settings['num_draft_tokens']}",
        f"  {first:<{width}} {'tok/s':>7} {'vs plain':>8} {'accepted':>9} {'tok/step':>8} "
        f"{'same ids':>8}",
    ]
    for name, row in report["results"].items():
        accepted = f"{100 * row['acceptance_rate']:.0f}%" if "acceptance_rate" in row else "-"
        per_step = f"{row['tokens_per_step']:.2f}" if "tokens_per_step" in row else "-"
        same = {True: "yes", False: "NO"}.get(row.get("same_tokens"), "-")
        lines.append(f"  {name:<{width}} {row['decode_tps']:>7.2f} "
                     f"{row['ratio_vs_plain']:>7.2f}x {accepted:>9} {per_step:>8} {same:>8}")
    return lines
