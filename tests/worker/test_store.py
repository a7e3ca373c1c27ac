import shutil

import pytest

from engine.errors import ShoalError
from engine.sharding import shard
from worker.store import scan_stores


@pytest.fixture
def sharded(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False)
    return out


def test_scan_finds_every_expert_of_its_stores(sharded):
    scan = scan_stores([sharded / "worker-0", sharded / "worker-1"])
    assert len(scan.held) == 24 and not scan.problems


def test_corrupt_and_truncated_files_are_reported_with_their_path_and_kept(sharded):
    store = sharded / "worker-0"
    files = sorted(store.glob("L*/E*.safetensors"))
    flipped, cut = files[0], files[1]
    data = bytearray(flipped.read_bytes())
    data[-1] ^= 0xFF
    flipped.write_bytes(bytes(data))
    cut.write_bytes(cut.read_bytes()[:-10])
    scan = scan_stores([store])
    assert len(scan.held) == len(files) - 2
    assert any(str(flipped) in p and "checksum" in p for p in scan.problems)
    assert any(str(cut) in p and "bytes" in p for p in scan.problems)
    assert flipped.exists() and cut.exists()


def test_a_copy_in_a_second_store_covers_a_corrupt_file(sharded, tmp_path):
    first = sharded / "worker-0"
    second = tmp_path / "second-drive"
    shutil.copytree(first, second)
    victim = sorted(first.glob("L*/E*.safetensors"))[0]
    victim.write_bytes(b"x" * victim.stat().st_size)
    scan = scan_stores([first, second])
    assert len(scan.held) == 12
    assert scan.held[(0, 0)].is_relative_to(second)
    assert len(scan.problems) == 1


def test_stores_of_different_models_are_refused(sharded, tiny_checkpoint, tmp_path):
    other = tmp_path / "other"
    shard(tiny_checkpoint("mixtral"), other, progress=False)
    with pytest.raises(ShoalError, match="different models"):
        scan_stores([sharded / "worker-0", other / "experts"])
