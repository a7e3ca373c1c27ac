"""What constrained decoding costs per step: coordinator/server/grammars.py's processor (mask,
unpacking, masked logits) on a real tokenizer, over answers walked through a JSON Schema
grammar."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.utils import load_tokenizer

from builders.demo_models import cache_root
from coordinator.server.grammars import Grammars, response_format_grammar

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                  "maxItems": 4},
                         "ok": {"type": "boolean"}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path,
                        default=cache_root() / "demo" / "smollm2-135m-instruct")
    parser.add_argument("--answers", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    vocab = len(tokenizer.get_vocab())
    grammars = Grammars(tokenizer)
    started = time.perf_counter()
    grammars.processor("start: \"x\"")  # builds llguidance's view of the tokenizer
    setup = time.perf_counter() - started
    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": SCHEMA}})
    steps: list[float] = []
    rng = np.random.default_rng(0)
    for _ in range(args.answers):
        processor = grammars.processor(grammar)
        context = [0]
        for _ in range(400):
            logits = mx.array(rng.normal(size=(1, vocab)).astype(np.float32))
            t = time.perf_counter()
            masked = processor(mx.array(context), logits)
            mx.eval(masked)
            steps.append(time.perf_counter() - t)
            token = int(mx.argmax(masked, axis=-1).item())
            if token in tokenizer.eos_token_ids:
                break
            context.append(token)
    report = {"vocab": vocab, "tokenizer_setup_s": setup, "steps": len(steps),
              "step_ms_median": 1e3 * statistics.median(steps),
              "step_ms_p90": 1e3 * sorted(steps)[int(0.9 * len(steps))]}
    if args.json:
        print(json.dumps(report))
    else:
        print(f"vocabulary {vocab} tokens; llguidance's tokenizer built in "
              f"{report['tokenizer_setup_s']:.2f} s; {len(steps)} constrained steps: "
              f"{report['step_ms_median']:.2f} ms median, {report['step_ms_p90']:.2f} ms p90")


if __name__ == "__main__":
    main()
