"""A cluster of real worker processes must reproduce mlx-lm's single-process output exactly:
same greedy token ids, logits within 1e-5, for four MoE families (Kimi K3 with its experts in a
latent space among them), float32 and 4-bit, and clusters of 1, 2 and 3 workers with uneven
(and partly replicated) expert splits. tests/integration/test_families.py checks every other
mlx-lm MoE family with two workers."""

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, quantize_model

from coordinator.decoding.generate import open_remote_model
from engine.auth import load_secret
from engine.manifest import MANIFEST_NAME, read_manifest
from engine.sharding import shard

PROMPT = [5, 17, 42, 99, 7, 250, 33, 64, 128, 12]
NEW_TOKENS = 12
GROUP_SIZE = 32  # the tiny models' expert width is 32

# (family, checkpoint quantized in mlx-lm's layout, source layout, quantize while sharding)
CASES = [
    ("qwen3_moe", None, "mlx", None),
    ("qwen3_moe", 4, "mlx", None),
    ("mixtral", None, "hf", None),
    ("mixtral", None, "hf", 4),
    ("deepseek_v3", None, "hf", None),
    ("deepseek_v3", 4, "mlx", None),
    # Kimi K3's routed experts run 32 wide inside its 64-wide model, its shared expert on the
    # block's input: the switch's input is not the block's.
    ("kimi_k3", None, "mlx", None),
    ("kimi_k3", 4, "mlx", None),
]


def uneven_split(keys: list, workers: int) -> list[list]:
    """1 worker: all. 2: about 70/30. 3: about 50/33/17, the third also copying some of the
    first's experts, so the routing table has replicas to choose between."""
    if workers == 1:
        return [keys]
    if workers == 2:
        return [[k for i, k in enumerate(keys) if i % 10 < 7],
                [k for i, k in enumerate(keys) if i % 10 >= 7]]
    shares = [[k for i, k in enumerate(keys) if i % 6 < 3],
              [k for i, k in enumerate(keys) if i % 6 in (3, 4)],
              [k for i, k in enumerate(keys) if i % 6 == 5]]
    shares[2] += shares[0][::4]
    return shares


def make_stores(sharded: Path, root: Path, shares: list[list]) -> list[Path]:
    manifest = read_manifest(sharded)
    stores = []
    for index, keys in enumerate(shares):
        store = root / f"store-{index}"
        store.mkdir(parents=True)
        shutil.copy(sharded / MANIFEST_NAME, store / MANIFEST_NAME)
        for layer, expert in keys:
            name = manifest.expert(layer, expert).file
            (store / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(sharded / "experts" / name, store / name)
        stores.append(store)
    return stores


def greedy_tokens(model, prompt: list[int], count: int) -> list[int]:
    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=count):
        tokens.append(int(token))
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("family,bits,layout,shard_bits", CASES)
def test_cluster_matches_single_process(
    family, bits, layout, shard_bits, tiny_checkpoint, tmp_path, start_worker, secret_file
):
    source = tiny_checkpoint(family, quantize_bits=bits, layout=layout)
    reference, config = load_model(source)
    if shard_bits is not None:
        reference, _ = quantize_model(reference, config, GROUP_SIZE, shard_bits)
    expected_logits = reference(mx.array([PROMPT]))
    expected_tokens = greedy_tokens(reference, PROMPT, NEW_TOKENS)

    sharded = tmp_path / "sharded"
    manifest = shard(source, sharded, quantize_bits=shard_bits, group_size=GROUP_SIZE,
                     progress=False)
    keys = sorted((e.layer, e.expert) for e in manifest.experts)
    secret = load_secret(secret_file)
    for workers in (1, 2, 3):
        stores = make_stores(sharded, tmp_path / f"cluster-{workers}",
                             uneven_split(keys, workers))
        running = [start_worker([store], forked=True) for store in stores]
        remote = open_remote_model(sharded, [w.address for w in running], secret)
        try:
            logits = remote.model(mx.array([PROMPT]))
            difference = mx.abs(logits - expected_logits).max().item()
            assert difference <= 1e-5, f"{workers} workers: logits differ by {difference}"
            tokens = greedy_tokens(remote.model, PROMPT, NEW_TOKENS)
            assert tokens == expected_tokens, f"{workers} workers"
            # a prompt pass sent as pieces of a few pairs (the workers compute one while the
            # next arrives), over several connections a worker, gives the same bits as the
            # whole call
            remote.dispatcher.piece_pairs = 4
            remote.dispatcher.stats.reset()
            pieced = remote.model(mx.array([PROMPT]))
            assert mx.array_equal(pieced, logits), f"{workers} workers, in pieces"
            prompt_pass = remote.dispatcher.stats.prefill
            assert prompt_pass.requests > workers * prompt_pass.calls, "no call went in pieces"
            links = remote.dispatcher.cluster.links
            assert max(link.connections for link in links) > 1
            mx.eval(remote.model(mx.array([PROMPT[:1]])))  # a decode-sized call ends the rest
            assert [link.open_streams for link in links] == [1] * len(links)
            served = remote.dispatcher.stats.worker_requests
            assert all(served[w.address] > 0 for w in running), served
        finally:
            remote.close()
            for worker in running:
                worker.stop()
