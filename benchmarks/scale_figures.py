"""docs/streaming.md's scaling tables, rendered from `streaming-scale` records (`<!-- rendered:
scale@RECORD -->` names one; `scale` alone, the newest): `python -m benchmarks.scale_figures`
fills every such block again from docs/measurements/."""

from __future__ import annotations

from pathlib import Path

from benchmarks.figures import BLOCK, MissingFigure, Records, newest
from benchmarks.records import REPO, load, results_folder

DOC = REPO / "docs" / "streaming.md"
MIB = 1 << 20


def _record(records: Records, folder: Path, stem: str) -> tuple[Path, dict]:
    """The record named `stem` in `folder`, or with none named the newest scale record."""
    if stem:
        path = folder / f"{stem}.json"
        if not path.is_file():
            raise MissingFigure(f"docs/streaming.md cites {path.name}, not in {folder}")
        return path, load(path)
    found = [v for (_, what), v in records.items() if what == "streaming-scale"]
    if not found:
        raise MissingFigure("no streaming-scale record in the results folder")
    return max(found, key=lambda v: v[1]["recorded"])


def points_of(figures: dict) -> list[dict]:
    """A scale run's rows, the mixed drives' last (each drive-copies count tried, where the
    record has them)."""
    mixed = figures.get("mixed_drives_copies") or (
        [figures["mixed_drives"]] if figures["mixed_drives"] else [])
    return [*figures["rows"], *mixed]


def _drives(row: dict) -> str:
    return "/".join(f"{r:g}" for r in row["drive_mbps"])


def _percents(values: list) -> str:
    return ", ".join("-" if v is None else f"{100 * v:.0f}%" for v in values)


def caption(path: Path, record: dict) -> list[str]:
    f = record["figures"]
    return [f"Measured on `{record['machine']['label']}` ({record['machine']['cpus']} CPUs, "
            f"load average after {f['load_after'][0]:.1f}), {f['decode_tokens']} decode "
            f"tokens, each member {f['drive_mbps']:g} MB/s, "
            f"{f['memory_budget'] / MIB:.1f} MiB budget and {f['cpu_share']:g} of a core, "
            f"at commit {record['commit']}: `{record['command']}` "
            f"([{path.name}](measurements/{path.name}))."]


def scale_table(path: Path, record: dict) -> list[str]:
    f = record["figures"]
    lines = ["| members | drives MB/s | tok/s | x one | ideal | forecast | hit rate | "
             "read / demand MiB a token | drive busy | CPU busy | exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in points_of(f):
        off = row["forecast_tok_s"] / row["tok_s"] - 1
        lines.append(
            f"| {row['members']} | {_drives(row)} | {row['tok_s']:.3f} | {row['x_one']:.2f} | "
            f"{row['ideal_x']:.2f} | {row['forecast_tok_s']:.3f} ({100 * off:+.0f}%) | "
            f"{100 * (row['hit_rate'] or 0):.1f}% | "
            f"{row['read_bytes_per_token'] / MIB:.1f} / {row['demand_bytes_per_token'] / MIB:.1f}"
            f" | {_percents(row['drive_busy'])} | {_percents(row['cpu_busy'])} | "
            f"{'yes' if row['exact'] else 'NO'} |")
    return lines


def admission_table(path: Path, record: dict) -> list[str]:
    rows = [row for row in points_of(record["figures"]) if "every_read_kept" in row]
    if not rows:
        raise MissingFigure(f"{path.name} has no --admission-ab runs")
    lines = ["| members | drives MB/s | tok/s: admission / every read kept | hit rate | "
             "read MiB a token | read / demand | exact |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        every = row["every_read_kept"]
        lines.append(
            f"| {row['members']} | {_drives(row)} | {row['tok_s']:.3f} / {every['tok_s']:.3f} | "
            f"{100 * (row['hit_rate'] or 0):.1f}% / {100 * (every['hit_rate'] or 0):.1f}% | "
            f"{row['read_bytes_per_token'] / MIB:.1f} / {every['read_bytes_per_token'] / MIB:.1f}"
            f" | {row['read_bytes_per_token'] / row['demand_bytes_per_token']:.2f} / "
            f"{every['read_bytes_per_token'] / every['demand_bytes_per_token']:.2f} | "
            f"{'yes' if row['exact'] and every['exact'] else 'NO'} |")
    return lines


def copies_table(path: Path, record: dict) -> list[str]:
    """One drive copy of each cold expert against two, the runs of a point back to back."""
    rows = points_of(record["figures"])
    if len({row.get("drive_copies", 1) for row in rows}) < 2:
        raise MissingFigure(f"{path.name} has no --drive-copies runs")
    lines = ["| members | drives MB/s | drive copies | tok/s | x one | drive busy (mean) | "
             "read / demand MiB a token | read / demand | experts stored | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        busy = row["drive_busy"]
        lines.append(
            f"| {row['members']} | {_drives(row)} | {row.get('drive_copies', 1)} | "
            f"{row['tok_s']:.3f} | {row['x_one']:.2f} | {_percents(busy)} "
            f"({100 * sum(busy) / len(busy):.0f}%) | "
            f"{row['read_bytes_per_token'] / MIB:.1f} / {row['demand_bytes_per_token'] / MIB:.1f}"
            f" | {row['read_bytes_per_token'] / row['demand_bytes_per_token']:.2f} | "
            f"{row['stored_bytes'] / 2**30:.2f} GiB | {'yes' if row['exact'] else 'NO'} |")
    return lines


BLOCKS = {"scale-caption": caption, "scale": scale_table, "scale-admission": admission_table,
          "scale-copies": copies_table}


def render_scale(text: str, folder: Path) -> str:
    """docs/streaming.md's text with every scale block filled again from the records."""
    records = newest(folder)

    def fill(match) -> str:
        name, _, stem = match.group(2).partition("@")
        if name not in BLOCKS:
            raise MissingFigure(f"docs/streaming.md names a block {name!r} that has no table")
        lines = BLOCKS[name](*_record(records, folder, stem))
        return match.group(1) + "\n".join(lines) + "\n" + match.group(3)

    return BLOCK.sub(fill, text)


def render_streaming(doc: Path = DOC, folder: Path | None = None) -> Path:
    doc.write_text(render_scale(doc.read_text(), folder or results_folder()))
    return doc


if __name__ == "__main__":
    print(f"rendered {render_streaming()}")
