"""`shoal workers`' rows and table, from members built as plain data."""

from dataclasses import replace

from coordinator.cli.workers_command import format_table
from coordinator.cluster.member import Member
from coordinator.ops.ops_report import member_rows
from engine.interfaces import Route


def member(**changes) -> Member:
    base = Member(key="studio-a._shoal._tcp.local.", node_id="studio-a",
                  address="169.254.3.4:50551", route=Route("169.254.3.4", "bridge0", "thunderbolt"),
                  state="healthy", memory_budget=1 << 30, rtt_ms=0.4321)
    return replace(base, **changes)


def test_a_row_is_plain_data_and_the_table_shows_its_path_and_budget():
    [row] = member_rows([member()])
    assert (row["path"], row["interface"], row["rtt_ms"]) == ("thunderbolt", "bridge0", 0.432)
    assert not row["duplicate_node_id"]
    table = format_table([row])
    assert "bridge0 (thunderbolt)" in table and "1.0 GiB" in table and "0.4 ms" in table


def test_a_duplicated_node_id_is_marked_in_the_table_with_what_to_do():
    a = member()
    b = replace(a, key="studio-a-2._shoal._tcp.local.", address="10.0.0.10:50551")
    rows = member_rows([a, b])
    assert all(r["duplicate_node_id"] for r in rows)
    table = format_table(rows)
    assert "duplicate id" in table and "node id studio-a is used by several workers" in table


def test_why_a_worker_is_not_healthy_is_said_under_the_table():
    rows = member_rows([member(state="unreachable", detail="no answer", rtt_ms=None)])
    table = format_table(rows)
    assert table.split("\n")[1].endswith("-")  # no round trip to show
    assert table.endswith("\n  worker studio-a at 169.254.3.4:50551 is unreachable: no answer")
