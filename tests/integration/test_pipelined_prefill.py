"""A long prompt's pass pipelined over two real workers (coordinator/decoding/pipelined_prefill.py):
its chunks overlap (one's experts out while the next's attention runs), and the logits and the
greedy tokens equal mlx-lm's in one process, float32 and 4-bit."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from coordinator.decoding.generate import generate, open_remote_model
from coordinator.decoding.pipelined_prefill import pipelined_prefill, worth_pipelining
from engine.auth import load_secret
from engine.sharding import shard

PROMPT = [(11 * i + 3) % 290 + 5 for i in range(600)]  # the tiny vocabulary holds 300 ids
CHUNK = 32


@pytest.mark.parametrize("family,bits", [("qwen3_moe", None), ("deepseek_v3", 4)])
def test_a_pipelined_prompt_pass_gives_mlx_lms_logits_and_tokens(
        family, bits, tiny_checkpoint, tmp_path, start_worker, secret_file):
    source = tiny_checkpoint(family, quantize_bits=bits)
    reference = load_model(source)[0]
    cache = make_prompt_cache(reference)
    reference(mx.array([PROMPT[:-1]]), cache=cache)
    expected = reference(mx.array([PROMPT[-1:]]), cache=cache)
    expected_tokens = [int(t) for t, _ in generate_step(mx.array(PROMPT), reference,
                                                        max_tokens=6)]

    sharded = tmp_path / "sharded"
    shard(source, sharded, workers=2, progress=False)
    running = [start_worker([sharded / f"worker-{k}"], forked=True) for k in range(2)]
    remote = open_remote_model(sharded, [w.address for w in running],
                               load_secret(secret_file))
    try:
        assert worth_pipelining(remote.dispatcher, len(PROMPT) - 1)
        cache = make_prompt_cache(remote.model)
        hand_overs = pipelined_prefill(remote.model, remote.dispatcher, PROMPT[:-1], cache,
                                       chunk=CHUNK)
        logits = remote.model(mx.array([PROMPT[-1:]]), cache=cache)
        difference = mx.abs(logits - expected).max().item()
        assert difference <= 1e-5, difference
        # every chunk but the first and last handed over at each MoE layer
        chunks = -(-(len(PROMPT) - 1) // CHUNK)
        layers = len(remote.manifest.layers)
        assert hand_overs >= (chunks - 2) * layers, (hand_overs, chunks, layers)
        # the lanes were left with nothing owed: a decode-sized call goes through
        mx.eval(remote.model(mx.array([PROMPT[:1]])))
        result = generate(remote.model, remote.tokenizer, PROMPT, max_tokens=6,
                          dispatcher=remote.dispatcher)  # chunks of 256: three
        assert result.prompt_token_ids == PROMPT and result.prefill_tps > 0
        assert result.token_ids == [t for t in expected_tokens
                                    if t not in remote.tokenizer.eos_token_ids][:6]
    finally:
        remote.close()
