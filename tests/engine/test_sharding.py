import json
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.utils import save_config, save_model

from engine.errors import CorruptData, ShoalError
from engine.manifest import MANIFEST_NAME, read_manifest, sha256_file
from engine.moe_layers import check_safetensors
from engine.sharding import shard


def save_mlx_model(module, config: dict, out_dir):
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    return out_dir


@pytest.fixture(scope="module")
def dense_llama(tmp_path_factory):
    from mlx_lm.models import llama

    config = dict(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=64)
    return save_mlx_model(llama, config, tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from mlx_lm.models import gpt_oss

    config = dict(model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4,
                  num_experts_per_tok=2, vocab_size=64, hidden_size=32, intermediate_size=32,
                  head_dim=16, num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                  layer_types=["sliding_attention", "full_attention"])
    return save_mlx_model(gpt_oss, config, tmp_path_factory.mktemp("gpt_oss"))


def test_shard_writes_dense_part_one_file_per_expert_and_balanced_stores(
    tiny_checkpoint, tmp_path
):
    source = tiny_checkpoint("qwen3_moe")
    out = tmp_path / "out"
    manifest = shard(source, out, workers=3, progress=False)

    assert [layer.layer for layer in manifest.layers] == [0, 1, 2]
    assert len(manifest.experts) == 3 * 8
    totals = []
    for k in range(3):
        store = out / f"worker-{k}"
        assert read_manifest(store).fingerprint == manifest.fingerprint
        files = sorted(store.glob("L*/E*.safetensors"))
        totals.append(sum(f.stat().st_size for f in files))
    assert sum(len(list((out / f"worker-{k}").glob("L*/E*"))) for k in range(3)) == 24
    assert max(totals) - min(totals) <= max(e.bytes for e in manifest.experts)
    for entry in manifest.experts:
        holders = [out / f"worker-{k}" / entry.file for k in range(3)]
        present = [p for p in holders if p.exists()]
        assert len(present) == 1
        assert sha256_file(present[0]) == entry.sha256
        assert present[0].stat().st_size == entry.bytes
        tensors = mx.load(str(present[0]))
        assert set(tensors) == set(manifest.layer(entry.layer).params)

    index = json.loads((out / "dense" / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if ".switch_mlp." in k]
    assert any(".mlp.gate." in k for k in index["weight_map"])
    assert (out / "dense" / "tokenizer.json").exists()
    assert json.loads((out / "dense" / "config.json").read_text())["model_type"] == "qwen3_moe"


def test_shard_again_into_a_finished_split_needs_force_and_gives_same_fingerprint(
    tiny_checkpoint, tmp_path
):
    source = tiny_checkpoint("mixtral")
    first = shard(source, tmp_path / "out", progress=False)
    with pytest.raises(ShoalError, match=r"already holds a finished split.*experts/.*--force"):
        shard(source, tmp_path / "out", progress=False)
    again = shard(source, tmp_path / "out", progress=False, force=True)
    assert again.fingerprint == first.fingerprint
    assert (tmp_path / "out" / "experts" / MANIFEST_NAME).exists()


def test_shard_quantizes_experts_with_mlx_lm(tiny_checkpoint, tmp_path):
    manifest = shard(tiny_checkpoint("mixtral"), tmp_path / "q", quantize_bits=4, group_size=32,
                     progress=False)
    assert manifest.quantization["bits"] == 4
    assert "gate_proj.scales" in manifest.layers[0].params
    float_manifest = shard(tiny_checkpoint("mixtral"), tmp_path / "f", progress=False)
    assert manifest.experts[0].bytes < float_manifest.experts[0].bytes


def test_shard_refuses_a_dense_model(dense_llama, tmp_path):
    with pytest.raises(ShoalError, match="'llama' is a dense model"):
        shard(dense_llama, tmp_path / "out", progress=False)


def test_shard_finds_the_switch_module_by_class_not_by_name(gpt_oss, tmp_path):
    manifest = shard(gpt_oss, tmp_path / "out", progress=False)  # gpt_oss keeps `experts`
    assert [layer.path for layer in manifest.layers] == [
        "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert [layer.num_experts for layer in manifest.layers] == [4, 4]


def test_shard_refuses_experts_outside_a_switch_module(tmp_path):
    from mlx_lm.models import llama

    # A nested config that states experts (as llama4's and gemma4's text_config do) while
    # the model builds no SwitchGLU/SwitchMLP: named for what it is, not called dense.
    config = dict(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                  num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=64,
                  text_config={"num_local_experts": 4})
    source = save_mlx_model(llama, config, tmp_path / "src")
    with pytest.raises(ShoalError, match="has experts, but .* SwitchGLU/SwitchMLP"):
        shard(source, tmp_path / "out", progress=False)


def test_shard_refuses_truncated_weights(tiny_checkpoint, tmp_path):
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), source)
    weights = sorted(source.glob("model*.safetensors"))[0]
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CorruptData, match="truncated"):
        shard(source, tmp_path / "out", progress=False)
    with pytest.raises(CorruptData, match="truncated"):
        check_safetensors(weights)


def test_shard_refuses_a_folder_holding_another_model(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    (out / MANIFEST_NAME).unlink()  # an interrupted split
    with pytest.raises(ShoalError, match="already holds a different model"):
        shard(tiny_checkpoint("mixtral"), out, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ShoalError, match="not written by `shoal shard`"):
        shard(tiny_checkpoint("mixtral"), tmp_path / "other", progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_shard_refuses_missing_config(tmp_path):
    with pytest.raises(ShoalError, match="no config.json"):
        shard(tmp_path, tmp_path / "out", progress=False)


def test_shard_command_reports_errors_without_traceback(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "coordinator.cli", "shard", str(tmp_path), str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2
    assert "shoal: error:" in run.stderr and "no config.json" in run.stderr
    assert "Traceback" not in run.stderr


def test_shard_refuses_a_folder_split_for_another_number_of_workers(tiny_checkpoint, tmp_path):
    source, out = tiny_checkpoint("qwen3_moe"), tmp_path / "out"
    shard(source, out, workers=2, progress=False)
    (out / MANIFEST_NAME).unlink()  # an interrupted split
    before = sorted(p.name for p in (out / "worker-0").rglob("*.safetensors"))
    # More workers: worker-0 and worker-1 exist under both splits, with other experts each.
    with pytest.raises(ShoalError, match=r"split into 2 store folders .* not 4 store folders"):
        shard(source, out, workers=4, progress=False)
    with pytest.raises(ShoalError, match="one store folder"):
        shard(source, out, progress=False)
    assert sorted(p.name for p in (out / "worker-0").rglob("*.safetensors")) == before
    assert not (out / "worker-2").exists()
    shard(source, out, workers=2, progress=False)  # the same split again is still a resume


def test_shard_reads_a_hugging_face_cache_entry_with_symlinked_blobs(tiny_checkpoint, tmp_path):
    """models--ORG--NAME/snapshots/HASH/* are symlinks into blobs/, as `hf download` leaves."""
    import hashlib
    import os

    source = tiny_checkpoint("mixtral")
    entry = tmp_path / "hub" / "models--org--tiny-mixtral"
    snapshot = entry / "snapshots" / ("ab" * 20)
    (entry / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in source.iterdir():
        blob = entry / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("ab" * 20)
    direct = shard(source, tmp_path / "direct", progress=False)
    for given in (entry, snapshot):
        cached = shard(given, tmp_path / f"from-{given.name}", progress=False)
        assert cached.fingerprint == direct.fingerprint
        dense = tmp_path / f"from-{given.name}" / "dense"
        assert not any(p.is_symlink() for p in dense.iterdir())  # copies, not links


def test_expert_entries_carry_a_crc32_and_manifests_read_both_ways(tiny_checkpoint, tmp_path):
    """Each expert's CRC-32 is computed at shard time; a manifest written before it existed
    (no crc32) and one with a field a later version added both still read."""
    import json
    import zlib

    from engine.manifest import MANIFEST_NAME, Manifest, read_manifest
    from engine.sharding import shard

    out = tmp_path / "out"
    manifest = shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    for e in manifest.experts:
        assert e.crc32 == f"{zlib.crc32((out / 'experts' / e.file).read_bytes()):08x}"
    body = json.loads((out / "experts" / MANIFEST_NAME).read_text())
    for e in body["experts"]:
        del e["crc32"]
    old = Manifest.from_json(json.dumps(body), origin="old")
    assert all(e.crc32 == "" for e in old.experts)
    assert old.fingerprint == read_manifest(out / "experts").fingerprint
    for e in body["experts"]:
        e["added_later"] = 1
    assert Manifest.from_json(json.dumps(body), origin="newer").experts == old.experts


def test_shard_writes_each_expert_to_every_store_the_placement_names(tiny_checkpoint, tmp_path):
    from engine.placement import WorkerCapacity, store_placement

    members = [WorkerCapacity("a", 60_000, None, 0.04), WorkerCapacity("b", 60_000, None, 0.08)]
    planned = {}

    def place(sizes):
        planned.update(store_placement(members, sizes, None, top_k=2))
        planned[(0, 0)] = (0, 1)  # a replica: written to both stores
        return planned

    out = tmp_path / "out"
    manifest = shard(tiny_checkpoint("qwen3_moe"), out, workers=2, progress=False, place=place)
    for index in (0, 1):
        files = {(e.layer, e.expert) for e in manifest.experts
                 if (out / f"worker-{index}" / e.file).is_file()}
        assert files == {key for key, stores in planned.items() if index in stores}
    replica = next(e for e in manifest.experts if (e.layer, e.expert) == (0, 0))
    assert all(sha256_file(out / f"worker-{k}" / replica.file) == replica.sha256 for k in (0, 1))
    # the faster drive holds more of the cold experts
    held = [sum(1 for stores in planned.values() if k in stores) for k in (0, 1)]
    assert held[1] > held[0]
    with pytest.raises(ShoalError, match="every expert at least one store"):
        shard(tiny_checkpoint("qwen3_moe"), tmp_path / "bad", workers=2, progress=False,
              place=lambda sizes: {})
