"""A block-level prefix cache with LRU eviction, as vLLM's automatic prefix caching works.

A prompt is cut into full blocks of ``block_size`` token ids; each block is named by a hash chained over
every block before it (``accounting/prefix.py``), so a block hit implies the whole prefix up to it matches.
Only whole blocks hit. Evictions are reported to ``on_evict`` (the KV events vLLM publishes, and the router's
index in the simulator).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Container, Sequence

from fairgate.accounting.prefix import block_hashes, usable_blocks

__all__ = ["PrefixCache", "block_hashes"]


@dataclass(slots=True)
class Stored:
    """A run of blocks newly cached, as a KV event names it: ``parent`` is the block before the run (None: the
    run starts the chain, whose first block's hash the ``salt`` entered), ``root`` the chain's first block."""

    hashes: list[int]
    parent: int | None
    root: int
    token_ids: Sequence[int]  # the run's tokens (empty when the caller gave none)
    salt: str | None = None


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries_total)
        self.hits = 0  # prompt tokens found (vllm:prefix_cache_hits_total)
        self.on_store: Callable[[Stored], None] | None = None  # each run of blocks newly stored (KV events)
        self.on_evict: Callable[[list[int]], None] | None = None  # blocks evicted (KV events, router index)
        self.version = 0  # moves whenever a block may have come or gone (a kept ``peek`` is good until then)

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def peek(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present, without touching them (a scheduler's look is not a use)."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present; touches them as most recently used."""
        n = self.peek(hashes)
        for h in hashes[:n]:
            self._lru.move_to_end(h)
        return n

    def cached_tokens(self, hashes: Sequence[int], prompt_len: int) -> int:
        """Prompt tokens a lookup would serve from the cache now (no touch)."""
        return self.peek(hashes[:usable_blocks(prompt_len, self.block_size)]) * self.block_size

    def lookup_blocks(self, hashes: Sequence[int], prompt_len: int) -> int:
        """Cached prompt tokens (at least one token is always computed); counts the query, touches the hit."""
        cached = self.match(hashes[:usable_blocks(prompt_len, self.block_size)]) * self.block_size
        self.queries += prompt_len
        self.hits += cached
        return cached

    def lookup(self, token_ids: Sequence[int], salt: str | None = None) -> tuple[int, list[int]]:
        """Cached prompt tokens for this prompt, and its block hashes."""
        hashes = block_hashes(token_ids, self.block_size, salt)
        return self.lookup_blocks(hashes, len(token_ids)), hashes

    def insert(self, hashes: Sequence[int], reserved_blocks: int = 0, in_use: Container[int] = (),
               token_ids: Sequence[int] = (), salt: str | None = None) -> None:
        """Add computed blocks (of a prompt made of ``token_ids`` under ``salt``, for the KV events), then evict
        least recently used blocks beyond the free capacity; blocks ``in_use`` by running requests are never
        evicted."""
        runs = self._new_runs(hashes, token_ids, salt) if self.on_store is not None else ()
        self.version += 1
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        for run in runs:
            self.on_store(run)
        excess = len(self._lru) - max(0, self.capacity_blocks - reserved_blocks)
        if excess > 0:
            gone = []
            for h in self._lru:
                if len(gone) == excess:
                    break
                if h not in in_use:
                    gone.append(h)
            for h in gone:
                del self._lru[h]
            if gone and self.on_evict is not None:
                self.on_evict(gone)

    def _new_runs(self, hashes: Sequence[int], token_ids: Sequence[int], salt: str | None) -> list[Stored]:
        runs: list[Stored] = []
        bs, i = self.block_size, 0
        while i < len(hashes):
            if hashes[i] in self._lru:
                i += 1
                continue
            j = i
            while j < len(hashes) and hashes[j] not in self._lru:
                j += 1
            runs.append(Stored(list(hashes[i:j]), hashes[i - 1] if i else None, hashes[0],
                               token_ids[i * bs:j * bs], salt if i == 0 else None))
            i = j
        return runs
