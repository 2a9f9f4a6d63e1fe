"""A block-level prefix cache with LRU eviction, as vLLM's automatic prefix caching works.

A prompt is cut into full blocks of ``block_size`` token ids; each block is named by a hash chained over
every block before it, so a block hit implies the whole prefix up to it matches. Only whole blocks hit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained block hashes; a ``cache_salt`` enters the first block's hash (as vLLM mixes it into the first
    block's extra keys), so prompts with different salts share no block."""
    hashes, parent = [], 0 if salt is None else hash(("cache_salt", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(self, capacity_blocks: int, block_size: int):
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries_total)
        self.hits = 0  # prompt tokens found (vllm:prefix_cache_hits_total)

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present; touches them as most recently used."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            self._lru.move_to_end(h)
            n += 1
        return n

    def lookup(self, token_ids: Sequence[int], salt: str | None = None) -> tuple[int, list[int]]:
        """Cached prompt tokens for this prompt (at least one token is always computed), and its block hashes."""
        hashes = block_hashes(token_ids, self.block_size, salt)
        # vLLM recomputes the last prompt token even on a full hit, so a full match counts one block less.
        usable = hashes[: (len(token_ids) - 1) // self.block_size]
        cached = self.match(usable) * self.block_size
        self.queries += len(token_ids)
        self.hits += cached
        return cached, hashes

    def insert(self, hashes: Sequence[int], reserved_blocks: int = 0) -> None:
        """Add computed blocks, then evict least recently used blocks beyond the free capacity."""
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        limit = max(0, self.capacity_blocks - reserved_blocks)
        while len(self._lru) > limit:
            self._lru.popitem(last=False)
