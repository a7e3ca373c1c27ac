"""`shoal heat` on a recorded heat file: the summary, the JSON that `shoal plan --heat` reads,
the PNG heat map, and clear refusals."""

import json

import pytest

from coordinator.cli.shoal_command import main
from coordinator.ops.heat_record import encode_record, load_record, record_path, summarize_heat
from engine.heat import HeatRecord, fold_reading
from engine.manifest import read_manifest
from engine.sharding import shard


@pytest.fixture(scope="module")
def recorded(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("heat") / "out"
    shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    record = HeatRecord(read_manifest(out).fingerprint)
    record = fold_reading(record, "a", "1", {(0, 3): 90, (0, 1): 10, (1, 2): 40})
    record = fold_reading(record, "b", "1", {(0, 3): 30, (1, 5): 40})
    record_path(out).write_bytes(encode_record(record))
    return out


def shoal(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_names_the_hottest_experts_the_skew_and_the_load_per_worker(recorded, capsys):
    code, out, _ = shoal(capsys, "heat", "--model", str(recorded), "--offline")
    assert code == 0
    assert "hottest experts" in out and "skew per layer" in out and "load per worker" in out
    first = out.splitlines()[3].split()
    assert first[:2] == ["0/3", "120"]  # 90 + 30 tokens, the hottest
    manifest = read_manifest(recorded)
    summary = summarize_heat(load_record(record_path(recorded), manifest.fingerprint), manifest)
    assert summary["workers"]["a"]["tokens"] == 140 and summary["layers"][0]["hottest"] == 3
    assert summary["measured_imbalance"] > 1.0


def test_json_is_what_plan_reads_and_layer_filters_it(recorded, capsys, tmp_path):
    code, out, _ = shoal(capsys, "heat", "--model", str(recorded), "--offline", "--json")
    assert code == 0
    assert json.loads(out) == {"0": {"1": 10, "3": 120}, "1": {"2": 40, "5": 40}}
    heat_file = tmp_path / "heat.json"
    heat_file.write_text(out)
    code, out, _ = shoal(capsys, "plan", "--model", str(recorded), "--worker", "a=1G",
                         "--worker", "b=1G", "--heat", str(heat_file), "--json")
    assert code == 0 and "0/3" in json.loads(out)["replicas"]
    code, out, _ = shoal(capsys, "heat", "--model", str(recorded), "--offline", "--json",
                         "--layer", "1")
    assert json.loads(out) == {"1": {"2": 40, "5": 40}}
    code, _, err = shoal(capsys, "heat", "--model", str(recorded), "--offline", "--layer", "9")
    assert code == 2 and "layer 9 has no routed experts" in err


def test_plot_writes_a_png_heat_map(recorded, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "heat.png"
    code, _, err = shoal(capsys, "heat", "--model", str(recorded), "--offline", "--plot",
                         str(png))
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_heat_it_says_how_to_get_some(tiny_checkpoint, tmp_path, capsys):
    out_dir = tmp_path / "out"
    shard(tiny_checkpoint("qwen3_moe"), out_dir, progress=False)
    code, out, _ = shoal(capsys, "heat", "--model", str(out_dir), "--offline")
    assert code == 0 and "no heat recorded yet" in out


def test_a_uniform_model_is_drawn_hot_on_a_scale_from_zero(tiny_checkpoint, tmp_path):
    """Every expert equally used: the map is one colour at the top of a 0..count bar (it was
    drawn in a middle colour on a bar around the single value)."""
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    from coordinator.ops.heat_record import colour_limits, plot_heat

    assert colour_limits(120) == (0.0, 120.0) and colour_limits(0) == (0.0, 1.0)
    out = tmp_path / "out"
    manifest = shard(tiny_checkpoint("qwen3_moe"), out, progress=False)
    counts = {(m.layer, e): 50 for m in manifest.layers for e in range(m.num_experts)}
    record = fold_reading(HeatRecord(manifest.fingerprint), "a", "1", counts)
    png = tmp_path / "uniform.png"
    plot_heat(record, manifest, png)
    pixels = imread(png)
    height, width = pixels.shape[:2]
    centre = pixels[height // 2, width // 3, :3]  # inside the map, left of the colour bar
    assert centre.sum() > 2.4, centre  # the hot end of inferno (about 2.6), not its middle
