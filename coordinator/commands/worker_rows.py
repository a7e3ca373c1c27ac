"""What `shoal workers` shows of each member: its row as plain data (also the --json output,
and what `shoal doctor` checks), and the table those rows print as."""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.membership import Member, duplicate_ids
from engine.cache_policy import format_bytes


def member_rows(members: Sequence[Member]) -> list[dict]:
    """What `shoal workers` shows, as plain data (also its --json)."""
    duplicates = duplicate_ids(members)
    return [
        {
            "node_id": m.node_id,
            "address": m.address,
            "interface": m.route.interface,
            "path": m.route.kind,
            "state": m.state,
            "detail": m.detail,
            "experts": m.experts_held,
            "memory_budget": m.memory_budget,
            "free_disk": m.free_disk,
            "rtt_ms": None if m.rtt_ms is None else round(m.rtt_ms, 3),
            "duplicate_node_id": m.node_id in duplicates,
            "model": m.advert.model if m.advert else None,
        }
        for m in members
    ]


def format_table(rows: Sequence[dict]) -> str:
    header = ("NODE ID", "ADDRESS", "PATH", "STATE", "EXPERTS", "MEMORY", "RTT")
    lines = [header]
    for r in rows:
        path = f"{r['interface']} ({r['path']})" if r["interface"] else r["path"]
        rtt = "-" if r["rtt_ms"] is None else f"{r['rtt_ms']:.1f} ms"
        state = r["state"] + (" (duplicate id)" if r["duplicate_node_id"] else "")
        lines.append((r["node_id"], r["address"], path, state, str(r["experts"]),
                      _size(r["memory_budget"]), rtt))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = "\n".join(
        "  ".join(cell.rjust(w) if i in (4, 5, 6) else cell.ljust(w)
                  for i, (cell, w) in enumerate(zip(line, widths, strict=True))).rstrip()
        for line in lines
    )
    notes = [f"{r['node_id']} ({r['address']}): {r['detail']}" for r in rows if r["detail"]]
    notes += [
        f"node id {node_id} is used by several workers ({', '.join(addresses)}): give each "
        "its own --node-id, or delete the copied ~/.config/shoal/node-id"
        for node_id, addresses in _duplicates_of(rows).items()
    ]
    return text + "".join(f"\n  {note}" for note in notes)


def _duplicates_of(rows: Sequence[dict]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for r in rows:
        if r["duplicate_node_id"]:
            found.setdefault(r["node_id"], []).append(r["address"])
    return found


def _size(count: int) -> str:
    return format_bytes(count) if count else "-"

