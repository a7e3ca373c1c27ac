"""Turn a dense Llama checkpoint into an mlx-lm `mixtral` checkpoint that computes the dense
model exactly while each token runs only `top_k` of its `num_experts` experts."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

from engine.errors import InvalidInput, NotFound

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class MoefyReport:
    """What a conversion built: experts per layer, experts per token, neurons per expert,
    copies of the slices, and how long it took."""

    num_experts: int
    top_k: int
    expert_size: int
    copies: int
    build_seconds: float


# Each MLP's neurons are cut into `top_k` slices, and the experts are `num_experts / top_k`
# copies of that set of slices (expert e is copy e % copies of slice e // copies: interleaved,
# so a split of the experts over workers by turns keeps a copy on one worker). The router gives
# every expert of a copy the same row, one random direction per copy, so a token's `top_k`
# largest logits are the experts of one copy: one of every slice. Mixtral's softmax then weights
# each 1/top_k, which the down projections, scaled by top_k, undo: every token sums each slice of
# the dense MLP once, while the routing is real. With top_k == num_experts there is one copy.
def moefy(
    dense_dir: Path,
    out_dir: Path,
    *,
    num_experts: int = 16,
    top_k: int | None = None,
    seed: int = 0,
) -> MoefyReport:
    """Write the `mixtral` checkpoint described in the module docstring to `out_dir`."""
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    start = time.perf_counter()
    config, weights = read_checkpoint(dense_dir)
    top_k = num_experts if top_k is None else top_k
    expert_size = check_split(config, num_experts, top_k)
    copies = num_experts // top_k
    moe_weights = mixtral_weights(weights, config, num_experts, top_k, seed)
    write_checkpoint(dense_dir, out_dir, mixtral_config(config, num_experts, top_k, expert_size),
                     moe_weights)
    return MoefyReport(num_experts, top_k, expert_size, copies, time.perf_counter() - start)


def read_checkpoint(model_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """config.json and every weight as float32 numpy (mx.load also reads bfloat16)."""
    config_path = model_dir / "config.json"
    files = sorted(model_dir.glob("model*.safetensors"))
    if not config_path.is_file() or not files:
        raise NotFound(
            f"{model_dir} is not a Hugging Face checkpoint (config.json and model*.safetensors); "
            "build one with builders.gguf_llama.gguf_to_llama"
        )
    config = json.loads(config_path.read_text())
    weights = {}
    for file in files:
        for name, array in mx.load(str(file)).items():
            weights[name] = np.array(array.astype(mx.float32))
    return config, weights


def check_split(config: dict, num_experts: int, top_k: int) -> int:
    """The per-expert intermediate size, after checking the dense model fits `mixtral` and
    the split works: top_k slices, num_experts / top_k copies of them."""
    if config.get("model_type") != "llama":
        raise InvalidInput(
            f"moefy converts Llama checkpoints; this one is {config.get('model_type')!r}"
        )
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    # mlx-lm's mixtral derives head_dim, has no attention bias and ignores rope scaling.
    if config.get("head_dim", hidden // heads) != hidden // heads:
        raise InvalidInput("moefy needs head_dim == hidden_size / num_attention_heads (mixtral)")
    if config.get("attention_bias") or config.get("mlp_bias") or config.get("rope_scaling"):
        raise InvalidInput("moefy needs a Llama without biases or rope scaling (mixtral)")
    intermediate = config["intermediate_size"]
    if not 1 <= top_k <= num_experts:
        raise InvalidInput(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    if num_experts % top_k:
        raise InvalidInput(
            f"top_k={top_k} must divide num_experts={num_experts}: the experts are "
            f"num_experts / top_k copies of top_k slices of each MLP (try 2, 4, 8 or 16)"
        )
    if intermediate % top_k:
        raise InvalidInput(
            f"top_k={top_k} must divide the MLP's intermediate_size={intermediate}"
        )
    return intermediate // top_k


def router_rows(hidden: int, num_experts: int, top_k: int, rng: np.random.Generator) -> np.ndarray:
    """(num_experts, hidden): one random unit direction per copy, the row of each of the copy's
    experts (expert e is of copy e % copies); all zero when there is one copy (every expert is
    chosen, equally)."""
    copies = num_experts // top_k
    if copies == 1:
        return np.zeros((num_experts, hidden), np.float32)
    directions = rng.standard_normal((copies, hidden))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    return np.tile(directions, (top_k, 1)).astype(np.float32)


def mixtral_weights(
    weights: dict[str, np.ndarray], config: dict, num_experts: int, top_k: int, seed: int
) -> dict[str, np.ndarray]:
    """The dense weights with each MLP replaced by the router and the stacked experts (mlx-lm's
    SwitchGLU layout); down projections scaled by top_k to undo the 1/top_k routing weights."""
    rng = np.random.default_rng(seed)
    out = {name: w for name, w in weights.items() if ".mlp." not in name}
    size = config["intermediate_size"] // top_k
    slices = [slice(s * size, (s + 1) * size) for s in range(top_k)]
    for layer in range(config["num_hidden_layers"]):
        mlp, moe = f"model.layers.{layer}.mlp", f"model.layers.{layer}.block_sparse_moe"
        gate, up, down = (weights[f"{mlp}.{name}_proj.weight"] for name in ("gate", "up", "down"))
        copies = num_experts // top_k
        order = [slices[e // copies] for e in range(num_experts)]  # expert e's slice
        out[f"{moe}.gate.weight"] = router_rows(config["hidden_size"], num_experts, top_k, rng)
        out[f"{moe}.switch_mlp.gate_proj.weight"] = np.stack([gate[s] for s in order])
        out[f"{moe}.switch_mlp.up_proj.weight"] = np.stack([up[s] for s in order])
        out[f"{moe}.switch_mlp.down_proj.weight"] = np.stack(
            [down[:, s] * np.float32(top_k) for s in order]
        )
    return out


def mixtral_config(config: dict, num_experts: int, top_k: int, expert_size: int) -> dict:
    """The dense config as `mixtral`; intermediate_size is per expert, as mixtral reads it."""
    keep = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "hidden_act",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
    )
    out = {key: config[key] for key in keep if key in config}
    out.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=expert_size,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
    )
    out.setdefault("tie_word_embeddings", False)
    return out


def write_checkpoint(
    dense_dir: Path, out_dir: Path, config: dict, weights: dict[str, np.ndarray]
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    contiguous = {name: np.ascontiguousarray(w, dtype=np.float32) for name, w in weights.items()}
    save_file(contiguous, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in _TOKENIZER_FILES:
        if (dense_dir / name).is_file():
            shutil.copyfile(dense_dir / name, out_dir / name)
