"""The heat record: workers count since they started; folding successive readings gives
totals that neither double-count nor lose a worker's restart, and survive a msgpack trip."""

import pytest

from coordinator.ops.heat_record import decode_record, encode_record, name_workers
from engine.errors import CorruptData
from engine.heat import HeatRecord, difference, fold_reading, heat_from_json, heat_to_json


def test_folding_readings_adds_only_what_is_new_and_survives_restarts():
    record = HeatRecord("fp")
    record = fold_reading(record, "a", "boot1", {(0, 1): 5, (1, 2): 3})
    record = fold_reading(record, "a", "boot1", {(0, 1): 5, (1, 2): 3})  # read twice
    assert record.total() == {(0, 1): 5, (1, 2): 3}
    record = fold_reading(record, "a", "boot1", {(0, 1): 9, (1, 2): 3})
    record = fold_reading(record, "b", "x", {(0, 1): 2})
    assert record.total() == {(0, 1): 11, (1, 2): 3}
    record = fold_reading(record, "a", "boot2", {(0, 1): 1})  # restarted: counts began anew
    assert record.total() == {(0, 1): 12, (1, 2): 3}
    record = fold_reading(record, "b", "x", {(0, 1): 1})  # fewer than seen: a restart too
    assert record.per_worker() == {"a": {(0, 1): 10, (1, 2): 3}, "b": {(0, 1): 3}}


def test_the_record_round_trips_through_msgpack_and_bad_bytes_are_refused():
    record = fold_reading(HeatRecord("fp"), "a", "b1", {(0, 1): 5, (3, 7): 2})
    again = decode_record(encode_record(record), origin="heat.msgpack")
    assert again == record
    with pytest.raises(CorruptData, match="heat.msgpack"):
        decode_record(b"\x93not msgpack", origin="heat.msgpack")


def test_json_form_and_run_difference():
    heat = {(0, 1): 5, (2, 0): 1}
    assert heat_from_json(heat_to_json(heat), origin="x") == {(0, 1): 5.0, (2, 0): 1.0}
    assert difference({(0, 1): 7, (0, 2): 1}, {(0, 1): 5, (0, 2): 1}) == {(0, 1): 2}


def test_worker_names_are_node_ids_unless_shared():
    assert name_workers([("a", "h:1"), ("b", "h:2")]) == ["a", "b"]
    assert name_workers([("a", "h:1"), ("a", "h:2"), ("c", "h:3")]) == ["a@h:1", "a@h:2", "c"]
