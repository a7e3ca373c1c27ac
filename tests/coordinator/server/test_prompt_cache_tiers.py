"""The prompt cache's disk tier over real files: found by shared blocks, kept across a new
DiskTier (a restart), evicted least-recently-used, another model's files unseen, a corrupt
file refused, and a prefix made redundant by a longer file removed."""

import logging

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from coordinator.server.prompt_cache_tiers import BLOCK, DiskTier, PromptCache, block_hashes

LAYERS = 2


def kv(tokens: list[int]) -> list[KVCache]:
    """A cache whose values name its tokens, so a wrong prefix would show."""
    out = []
    for layer in range(LAYERS):
        k = mx.array(tokens, dtype=mx.float32).reshape(1, 1, -1, 1) + layer
        out.append(KVCache.from_state((k, k * 2, len(tokens))))
    return out


def tokens_of(cache: list[KVCache]) -> list[int]:
    c = cache[0]
    return [int(t) for t in c.keys[..., :c.offset, :].reshape(-1).tolist()]


def test_block_hashes_name_prefixes_and_the_model():
    a = list(range(3 * BLOCK))
    b = a[:2 * BLOCK] + [7] * BLOCK
    assert block_hashes("m", a)[:2] == block_hashes("m", b)[:2]
    assert block_hashes("m", a)[2] != block_hashes("m", b)[2]
    assert block_hashes("m", a)[0] != block_hashes("other", a)[0]
    assert len(block_hashes("m", a[:BLOCK - 1])) == 0


def test_a_prefix_comes_back_after_a_restart_trimmed_to_what_is_shared(tmp_path):
    stored = list(range(1000, 1000 + 3 * BLOCK))
    DiskTier(tmp_path, "m", 1 << 30, LAYERS).write(stored, kv(stored))
    cache = PromptCache("m", 1 << 20, DiskTier(tmp_path, "m", 1 << 30, LAYERS))
    prompt = stored[:2 * BLOCK + 10] + [5, 6, 7]
    hit = cache.fetch(prompt)
    assert hit.tier == "disk" and hit.rest == [5, 6, 7]
    assert tokens_of(hit.cache) == prompt[:-3]
    assert PromptCache("m", 1 << 20, DiskTier(tmp_path, "x", 1 << 30, LAYERS)).fetch(
        prompt).cache is None  # another model's files are not this one's


def test_the_least_recently_used_file_goes_first_and_a_longer_file_replaces_its_prefix(
        tmp_path):
    disk = DiskTier(tmp_path, "m", 1 << 30, LAYERS)
    a, b = [1] * BLOCK, [2] * BLOCK
    disk.write(a, kv(a))
    disk.write(b, kv(b))
    disk.budget = disk.nbytes  # room for two
    disk.load(disk.longest(a)[0])  # a is now the more recent
    c = [3] * BLOCK
    disk.write(c, kv(c))
    assert disk.longest(b) is None and disk.longest(a) and disk.longest(c)
    disk.budget = 1 << 30
    longer = a + [4] * BLOCK
    disk.write(longer, kv(longer))
    assert disk.longest(a)[0].tokens == tuple(longer)
    assert len(list(tmp_path.glob("*.safetensors"))) == len(disk) == 2  # longer and c


def test_a_corrupt_file_is_a_miss_with_a_warning_and_is_removed(tmp_path, caplog):
    stored = list(range(BLOCK))
    DiskTier(tmp_path, "m", 1 << 30, LAYERS).write(stored, kv(stored))
    [path] = tmp_path.glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    cache = PromptCache("m", 1 << 20, DiskTier(tmp_path, "m", 1 << 30, LAYERS))
    with caplog.at_level(logging.WARNING, "shoal.serve"):
        hit = cache.fetch(stored + [1])
    assert hit.cache is None and hit.rest == stored + [1]
    assert "does not match its checksum" in caplog.text
    assert not list(tmp_path.glob("*.safetensors"))


def test_keep_writes_in_the_background_and_memory_answers_first(tmp_path):
    cache = PromptCache("m", 1 << 20, DiskTier(tmp_path, "m", 1 << 30, LAYERS))
    stored = list(range(BLOCK + 3))
    cache.keep(stored, kv(stored))
    cache.flush()
    assert cache.stats()["disk"]["entries"] == 1
    assert cache.fetch(stored + [9]).tier == "memory"
    cache.close()
