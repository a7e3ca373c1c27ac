"""The target an unfinished deploy or rebalance keeps in OUT_DIR/migration.json: read back as
written, ignored when it is another model's, refused when it is not JSON, gone once cleared."""

import pytest

from coordinator.ops.rebalancer import MIGRATION_FILE, clear_target, load_target, save_target
from engine.errors import CorruptData

TARGET = {(0, 1): ("a", "b"), (0, 0): ("b",), (3, 7): ("c",)}


def test_a_saved_target_reads_back_for_the_same_model(tmp_path):
    assert load_target(tmp_path, "model-1") is None  # nothing saved yet
    save_target(tmp_path, "model-1", TARGET)
    assert load_target(tmp_path, "model-1") == TARGET
    assert load_target(tmp_path, "model-2") is None  # another model's target is not taken up


def test_clearing_removes_it_and_clearing_twice_is_fine(tmp_path):
    save_target(tmp_path, "model-1", TARGET)
    clear_target(tmp_path)
    assert not (tmp_path / MIGRATION_FILE).exists()
    clear_target(tmp_path)
    assert load_target(tmp_path, "model-1") is None


def test_a_target_that_is_not_json_is_refused_with_what_to_do(tmp_path):
    (tmp_path / MIGRATION_FILE).write_text("{half a file")
    with pytest.raises(CorruptData, match="delete it to plan afresh"):
        load_target(tmp_path, "model-1")
