"""The family table: discovery from mlx-lm's models folder and the tiny configs themselves."""

from pathlib import Path

from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

from builders.families import TINY, discover
from builders.synthetic import random_model
from builders.synthetic_config import all_families, model_config


def test_discover_finds_switch_users_and_their_wrappers(tmp_path: Path):
    (tmp_path / "switch_layers.py").write_text("class SwitchGLU: ...\n")
    (tmp_path / "newmoe.py").write_text("from .switch_layers import SwitchGLU\n")
    (tmp_path / "newmoe_vl.py").write_text("from . import newmoe\n")
    (tmp_path / "newmoe_vl2.py").write_text("from .newmoe_vl import Model\n")
    (tmp_path / "dense.py").write_text("from .base import BaseModelArgs\n")
    assert discover(tmp_path) == ("newmoe", "newmoe_vl", "newmoe_vl2")


def test_every_mlx_lm_family_has_a_tiny_config():
    """Fast, so that a family a new mlx-lm adds fails the suite even without the slow sweep."""
    families = discover()
    assert {"kimi_k3", "gpt_oss", "llama4", "qwen3_vl_moe", "mixtral"} <= set(families)
    missing = [family for family in families if family not in all_families()]
    assert not missing, "no tiny config for " + ", ".join(missing)


def test_tiny_configs_build_tiny_models_with_experts():
    for family in sorted(TINY):
        model = random_model(model_config(family), seed=0)
        params = sum(v.size for _, v in tree_flatten(model.parameters()))
        # prism (128 wide for its 2-bit groups of 128) is the largest, at about 1.1M.
        assert params < 1_500_000, f"{family}: {params} parameters"
        switches = [m for _, m in model.named_modules() if isinstance(m, (SwitchGLU, SwitchMLP))]
        assert switches, f"{family}: no switch module"
