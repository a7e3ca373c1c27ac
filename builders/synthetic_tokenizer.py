"""The byte-level BPE tokenizer of every synthetic checkpoint: trained on a few fixed lines, so
the same files come out every time, with a chat template and special tokens."""

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS: tuple[str, ...] = ("<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_VOCAB_SIZE = 300  # 5 special + 256 byte tokens + 39 merges

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog, and the dog does not mind.
A shoal of fish moves as one, yet every fish swims on its own.
Hello world! Hello there, how are you today? I am well, thank you.
In a mixture of experts, a router sends every token to a few of the experts.
The experts live on many machines, and the answer comes back in the same order.
She sells sea shells by the sea shore; the shells she sells are sea shells.
"""


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json (with a chat_template) + special tokens."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer().save(str(out_dir / "tokenizer.json"))
    special = {"bos_token": "<|bos|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>"}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE: special tokens first, then the 256 bytes, then merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_TRAINING_TEXT.splitlines(), trainer=trainer)
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
