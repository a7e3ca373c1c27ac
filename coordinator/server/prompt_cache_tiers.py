"""`shoal serve`'s prompt cache in two tiers: mlx-lm's LRU of KV caches in memory, and files
on disk (coordinator/decoding/prompt_cache_file.py) written by a thread of their own after a request
ends, found by blocks of prompt tokens, evicted least-recently-used, kept across restarts."""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from coordinator.decoding.prompt_cache_file import read_checked, read_sidecar, write_checked
from engine.errors import InvalidInput

log = logging.getLogger("shoal.serve")

# Prompts are found on disk by their first blocks of this many tokens: a file is worth its
# read only for a prefix longer than a block, and a prompt's hashes stay few.
BLOCK = 256


@dataclass(frozen=True)
class Hit:
    """What the cache holds of a prompt: the KV cache of its first tokens (a copy the request
    may extend), the tokens still to compute (at least one), and which tier held it."""

    cache: list | None
    rest: list[int]
    tier: str | None = None  # "memory" or "disk"


def block_hashes(model: str, tokens: list[int]) -> list[bytes]:
    """One hash per whole block of `tokens`, each over the model and every token before the
    block's end, so equal hashes mean equal prefixes."""
    h = hashlib.blake2b(model.encode(), digest_size=16)
    out = []
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        h.update(array("q", tokens[end - BLOCK:end]).tobytes())
        out.append(h.copy().digest())
    return out


def common_prefix(a: list[int] | tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True)
class _Entry:
    name: str
    tokens: tuple[int, ...]
    hashes: tuple[bytes, ...]
    bytes: int
    sha256: str


class DiskTier:
    """The files of one model in `folder`, at most `budget` bytes; thread-safe."""

    def __init__(self, folder: Path, model: str, budget: int, layers: int) -> None:
        self.folder, self.model, self.budget, self.layers = folder, model, budget, layers
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._by_hash: dict[bytes, str] = {}
        self._scan()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.safetensors"

    def _scan(self) -> None:
        files = sorted(self.folder.glob("[!.]*.safetensors"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                meta = read_sidecar(path)
            except InvalidInput as e:
                log.warning("prompt cache: %s; removing it", e)
                self._unlink(path.stem)
                continue
            if meta.get("model") == self.model:
                self._add(path.stem, [int(t) for t in meta["tokens"]], meta["bytes"],
                          meta["sha256"])

    def _add(self, name: str, tokens: list[int], size: int, sha256: str) -> None:
        entry = _Entry(name, tuple(tokens), tuple(block_hashes(self.model, tokens)), size,
                       sha256)
        self._entries[name] = entry
        for h in entry.hashes:
            self._by_hash[h] = name

    def _drop(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            for h in entry.hashes:
                if self._by_hash.get(h) == name:
                    del self._by_hash[h]
        self._unlink(name)

    def _unlink(self, name: str) -> None:
        for path in (self._path(name), self._path(name).with_suffix(".json")):
            path.unlink(missing_ok=True)

    def longest(self, tokens: list[int]) -> tuple[_Entry, int] | None:
        """The file sharing the longest prefix with `tokens`, and that prefix's length."""
        with self._lock:
            for h in reversed(block_hashes(self.model, tokens)):
                name = self._by_hash.get(h)
                if name is not None:
                    entry = self._entries[name]
                    return entry, common_prefix(entry.tokens, tokens)
        return None

    def load(self, entry: _Entry) -> list | None:
        """The file's cache, or None (and a warning, the file removed) when it is refused."""
        path = self._path(entry.name)
        try:
            cache = read_checked(path, {"sha256": entry.sha256, "bytes": entry.bytes,
                                        "tokens": entry.tokens}, self.layers)
            mx.eval([c.state for c in cache])  # read now: the file may be evicted later
        except InvalidInput as e:
            log.warning("prompt cache: %s; computing the prompt again", e)
            with self._lock:
                self._drop(entry.name)
            return None
        with self._lock:
            if entry.name in self._entries:
                self._entries.move_to_end(entry.name)
        os.utime(path)  # the order survives a restart
        return cache

    def write(self, tokens: list[int], cache: list) -> None:
        """Keep `cache` (the KV cache of `tokens`) unless a file already holds it, then drop
        the files it makes redundant and the least recently used past the budget."""
        hashes = block_hashes(self.model, tokens)
        if not hashes:
            return
        with self._lock:
            name = self._by_hash.get(hashes[-1])
            known = self._entries.get(name) if name else None
            if known is not None and known.tokens[:len(tokens)] == tuple(tokens):
                self._entries.move_to_end(known.name)
                return
        name = hashlib.blake2b(hashes[-1] + str(len(tokens)).encode(),
                               digest_size=16).hexdigest()
        try:
            size, sha256 = write_checked(self._path(name), cache,
                                 {"model": self.model, "tokens": tokens})
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("prompt cache: cannot write %s: %s", self._path(name), e)
            return
        with self._lock:
            shorter = {self._by_hash.get(h) for h in hashes} - {None, name}
            for other in shorter:
                if tuple(tokens[:len(self._entries[other].tokens)]) == \
                        self._entries[other].tokens:
                    self._drop(other)
            self._add(name, tokens, size, sha256)
            while len(self._entries) > 1 and sum(
                    e.bytes for e in self._entries.values()) > self.budget:
                self._drop(next(iter(self._entries)))


class PromptCache:
    """Memory first, then disk; keep() returns at once, the file is written by a thread."""

    def __init__(self, model: str, memory_bytes: int, disk: DiskTier | None) -> None:
        self.model, self.memory_bytes, self.disk = model, memory_bytes, disk
        self.memory = LRUPromptCache(max_size=1 << 16, max_bytes=memory_bytes)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name="shoal prompt cache writer")
            self._writer.start()

    def stats(self) -> dict:
        out = {"entries": len(self.memory), "bytes": self.memory.nbytes,
               "limit": self.memory_bytes}
        if self.disk is not None:
            out["disk"] = {"entries": len(self.disk), "bytes": self.disk.nbytes,
                           "limit": self.disk.budget, "folder": str(self.disk.folder)}
        return out

    def fetch(self, tokens: list[int]) -> Hit:
        cache, rest = self.memory.fetch_nearest_cache(self.model, tokens)
        hit = Hit(cache, rest, "memory") if cache is not None else Hit(None, tokens)
        found = self.disk.longest(tokens) if self.disk is not None else None
        if found is not None and found[1] > len(tokens) - len(hit.rest):
            entry, shared = found
            loaded = self.disk.load(entry)
            if loaded is not None:
                shared = min(shared, len(tokens) - 1)
                trim_prompt_cache(loaded, len(entry.tokens) - shared)
                hit = Hit(loaded, tokens[shared:], "disk")
        if hit.cache is not None and not hit.rest:  # all cached: compute the last again
            if not can_trim_prompt_cache(hit.cache):
                return Hit(None, tokens)
            trim_prompt_cache(hit.cache, 1)
            hit = Hit(hit.cache, tokens[-1:], hit.tier)
        return hit

    def keep(self, tokens: list[int], cache: list) -> None:
        self.memory.insert_cache(self.model, list(tokens), cache)
        if self.disk is None or not all(type(c) is KVCache for c in cache):
            return
        n = cache[0].offset
        if n < BLOCK:
            return
        # Evaluated here, on the engine's thread, so that the writer only reads memory.
        states = [c.state for c in cache]
        mx.eval(states)
        snapshot = [KVCache.from_state(s) for s in states]
        self._writes.put((list(tokens[:n]), snapshot))

    def trim_to(self, n_bytes: int) -> None:
        self.memory.trim_to(n_bytes=n_bytes)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait (bounded) until every kept cache is on disk."""
        done = threading.Event()
        self._writes.put(done)
        if self._writer is not None:
            done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout)

    def _write_loop(self) -> None:
        with mx.stream(mx.new_stream(mx.cpu)):
            while (item := self._writes.get()) is not None:
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                try:
                    self.disk.write(*item)
                except Exception:  # noqa: BLE001 (a bad write must not stop the next ones)
                    log.exception("prompt cache: writing a file failed")
