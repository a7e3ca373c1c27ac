"""Split a dense Llama checkpoint's MLPs into routed experts and write an mlx-lm `mixtral`
checkpoint: exact when every token uses every expert, approximate with a router and experts
fitted on the model's own text when each token uses only some (the fitting is
builders/moefy_plan.py); and measure how closely the MoE follows the dense model."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
from safetensors.numpy import save_file
from tqdm import tqdm

from builders.moefy_plan import LayerPlan, Sequence, exact_plans, fitted_plans
from engine.errors import InvalidInput, NotFound

DEMO_PROMPT = "What is the capital of France?"
DEMO_TOKENS = 24
# Sampled completions of these are the text the router and experts are fitted on.
CALIBRATION_PROMPTS = (
    "Explain how rainbows form.",
    "Write a short poem about the sea.",
    "Give me a recipe for pancakes.",
    "How does a computer store numbers?",
)
# Greedy completions of these, never fitted on, measure how often the MoE agrees with the model.
HELD_OUT_PROMPTS = (
    "Why do cats purr?",
    "Describe the water cycle for a child.",
)
CALIBRATION_TEMPERATURE = 0.8
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class MoefyReport:
    """What a conversion built and, when top_k < num_experts, how closely it follows the dense
    model (agreement: share of held-out positions whose greedy next token matches)."""

    num_experts: int
    top_k: int
    expert_size: int
    calibration_tokens: int
    held_out_positions: int
    agreement: float | None
    demo_matches: bool | None
    dense_answer: str | None
    moe_answer: str | None
    build_seconds: float
    measure_seconds: float


@dataclass(frozen=True)
class Reference:
    """What the dense model wrote to compare against: greedy held-out sequences with their
    prompt lengths, and its greedy answer to DEMO_PROMPT."""

    held_out: tuple[tuple[Sequence, int], ...]
    demo_tokens: Sequence


@dataclass(frozen=True)
class Comparison:
    """How closely an MoE follows the dense model on a Reference."""

    agreement: float
    positions: int
    demo_matches: bool
    dense_answer: str
    moe_answer: str


def moefy(
    dense_dir: Path,
    out_dir: Path,
    *,
    num_experts: int = 16,
    top_k: int | None = None,
    seed: int = 0,
    progress: bool = True,
    calibration_tokens: int = 256,
    held_out_tokens: int = 96,
) -> MoefyReport:
    """Write a `mixtral` checkpoint to `out_dir` whose experts partition each dense MLP.

    With top_k == num_experts (the default) it computes the dense model exactly. Otherwise the
    dense model writes about `calibration_tokens` tokens to fit on, and about `held_out_tokens`
    more (plus an answer to DEMO_PROMPT) to measure agreement on.
    """
    dense_dir, out_dir = Path(dense_dir), Path(out_dir)
    start = time.perf_counter()
    config, weights = read_checkpoint(dense_dir)
    top_k = num_experts if top_k is None else top_k
    expert_size = check_split(config, num_experts, top_k)
    if top_k == num_experts:
        plans, calibration = exact_plans(config, weights, num_experts), ()
    else:
        model, tokenizer = load(str(dense_dir))
        calibration = calibration_text(model, tokenizer, calibration_tokens, seed, progress)
        plans = fitted_plans(model, weights, calibration, num_experts, top_k, seed, progress)
    moe_config = mixtral_config(config, num_experts, top_k, expert_size)
    write_checkpoint(dense_dir, out_dir, moe_config, mixtral_weights(weights, plans, top_k))
    build_seconds = time.perf_counter() - start
    if top_k == num_experts:
        return MoefyReport(
            num_experts, top_k, expert_size, 0, 0, None, None, None, None, build_seconds, 0.0
        )
    start = time.perf_counter()
    result = compare(out_dir, reference_text(model, tokenizer, held_out_tokens, progress))
    return MoefyReport(
        num_experts=num_experts,
        top_k=top_k,
        expert_size=expert_size,
        calibration_tokens=sum(len(ids) for ids in calibration),
        held_out_positions=result.positions,
        agreement=result.agreement,
        demo_matches=result.demo_matches,
        dense_answer=result.dense_answer,
        moe_answer=result.moe_answer,
        build_seconds=build_seconds,
        measure_seconds=time.perf_counter() - start,
    )


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
    """The per-expert intermediate size, after checking the dense model fits `mixtral`."""
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
    if num_experts < 1 or intermediate % num_experts:
        raise InvalidInput(
            f"num_experts={num_experts} must divide intermediate_size={intermediate}; "
            "pick a divisor such as 8 or 16"
        )
    if not 1 <= top_k <= num_experts:
        raise InvalidInput(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    return intermediate // num_experts


def chat_ids(tokenizer, prompt: str) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def generate_ids(
    model, tokenizer, prompt_ids: list[int], max_tokens: int, sampler=None
) -> list[int]:
    """Generated token ids (greedy unless a sampler is given), including a final EOS."""
    responses = stream_generate(
        model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=sampler
    )
    return [response.token for response in responses]


def calibration_text(
    model: nn.Module, tokenizer, tokens: int, seed: int, progress: bool
) -> tuple[Sequence, ...]:
    """Chat prompts with completions the dense model samples itself (via mlx-lm)."""
    mx.random.seed(seed)
    sampler = make_sampler(temp=CALIBRATION_TEMPERATURE)
    per_prompt = max(1, tokens // len(CALIBRATION_PROMPTS))
    sequences = []
    for prompt in tqdm(CALIBRATION_PROMPTS, desc="calibration text", disable=not progress):
        ids = chat_ids(tokenizer, prompt)
        sequences.append(tuple(ids + generate_ids(model, tokenizer, ids, per_prompt, sampler)))
    return tuple(sequences)


def reference_text(model: nn.Module, tokenizer, tokens: int, progress: bool) -> Reference:
    """The dense model's greedy completions of HELD_OUT_PROMPTS and DEMO_PROMPT."""
    per_prompt = max(1, tokens // len(HELD_OUT_PROMPTS))
    held_out = []
    for prompt in tqdm(HELD_OUT_PROMPTS, desc="held-out text", disable=not progress):
        ids = chat_ids(tokenizer, prompt)
        held_out.append((tuple(ids + generate_ids(model, tokenizer, ids, per_prompt)), len(ids)))
    demo = generate_ids(model, tokenizer, chat_ids(tokenizer, DEMO_PROMPT), DEMO_TOKENS)
    return Reference(tuple(held_out), tuple(demo))



def mixtral_weights(
    weights: dict[str, np.ndarray], plans: list[LayerPlan], top_k: int
) -> dict[str, np.ndarray]:
    """The dense weights with each MLP replaced by stacked experts (mlx-lm's SwitchGLU layout)
    and a router; down projections are scaled by top_k to undo the ~1/top_k routing weights."""
    out = {name: w for name, w in weights.items() if ".mlp." not in name}
    for layer, plan in enumerate(plans):
        mlp, moe = f"model.layers.{layer}.mlp", f"model.layers.{layer}.block_sparse_moe"
        gate, up = weights[f"{mlp}.gate_proj.weight"], weights[f"{mlp}.up_proj.weight"]
        out[f"{moe}.gate.weight"] = plan.router
        out[f"{moe}.switch_mlp.gate_proj.weight"] = np.stack([gate[g] for g in plan.groups])
        out[f"{moe}.switch_mlp.up_proj.weight"] = np.stack([up[g] for g in plan.groups])
        out[f"{moe}.switch_mlp.down_proj.weight"] = np.stack(
            [plan.down[:, g] * np.float32(top_k) for g in plan.groups]
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


def next_token_agreement(
    model: nn.Module, sequences: tuple[tuple[Sequence, int], ...]
) -> tuple[int, int]:
    """(matches, positions): how often the model's greedy next token, teacher-forced on each
    sequence, equals the token that follows in it after the prompt."""
    matches = positions = 0
    for ids, prompt_len in sequences:
        logits = model(mx.array([ids[:-1]]))[0, prompt_len - 1 :]
        predicted = np.array(mx.argmax(logits, axis=-1))
        matches += int((predicted == np.array(ids[prompt_len:])).sum())
        positions += len(ids) - prompt_len
    return matches, positions


def compare(moe_dir: Path, reference: Reference) -> Comparison:
    """Load the written MoE with mlx-lm and compare it with what the dense model wrote."""
    model, tokenizer = load(str(moe_dir))
    matches, positions = next_token_agreement(model, reference.held_out)
    moe_demo = generate_ids(model, tokenizer, chat_ids(tokenizer, DEMO_PROMPT), DEMO_TOKENS)
    return Comparison(
        agreement=matches / positions,
        positions=positions,
        demo_matches=tuple(moe_demo) == reference.demo_tokens,
        dense_answer=tokenizer.decode(list(reference.demo_tokens)),
        moe_answer=tokenizer.decode(moe_demo),
    )
