"""Prefix blocks: a prompt as a chain of block hashes, and an index of which backend probably holds which.

A prompt is cut into whole blocks of ``block_size`` tokens; each block is named by a hash chained over every
block before it (as vLLM's automatic prefix caching names them), so a block hit implies the whole prefix up to
it matches. A ``cache_salt`` enters the first block's hash, so prompts of tenants with different salts share no
block, in the engine and in the index alike. Hashes are stable across processes (ints and tuples of ints hash
deterministically in CPython; the salt goes through blake2b), so replicas agree on them.

Two ways to describe a prompt:
- ``block_hashes(token_ids)``: real token ids (the gateway, the emulated vLLM);
- ``segment_hashes(segments)``: a list of ``(segment_id, length)`` runs of distinct content (the simulator's
  workloads, and the Mooncake trace's 512-token block ids), without materialising token ids.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from itertools import repeat
from functools import lru_cache
from typing import Callable, Iterable, Sequence

from fairgate.accounting.tokenizer import response_messages

_DEEPEST = 1 << 62
Affects = Callable[[Sequence[int], int], bool]  # (a chain, its matched tokens) → may that match have moved?


@lru_cache(maxsize=4096)
def salt_seed(salt: str | None) -> int:
    if salt is None:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    hashes, parent = [], salt_seed(salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


def segment_hashes(segments: Sequence[tuple[int, int]], block_size: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the whole blocks of a prompt made of ``(segment_id, length)`` runs. A block's content
    is named by the (segment, offset) pieces it covers, so equal segment prefixes give equal hashes."""
    hashes, parent = [], salt_seed(salt)
    pieces: list[tuple[int, int, int]] = []
    filled = 0
    for seg, length in segments:
        pos = 0
        while pos < length:
            take = min(block_size - filled, length - pos)
            pieces.append((seg, pos, take))
            pos += take
            filled += take
            if filled == block_size:
                parent = hash((parent, tuple(pieces)))
                hashes.append(parent)
                pieces.clear()
                filled = 0
    return hashes


def prompt_blocks(tokenizer, endpoint: str, body: dict, block_size: int, salt: str | None) -> tuple[int, ...]:
    """A request body's prompt as salted block hashes, under the gateway's tokenizer and chat framing (the
    approximate index's view: exact for the emulated vLLM, close for a real chat template)."""
    if endpoint == "chat":
        ids = tokenizer.chat_ids(body["messages"])
    elif endpoint == "responses":  # (its whole conversation: a chain's turns share their prefix)
        ids = tokenizer.chat_ids(response_messages(body.get("instructions"), body["input"]))
    else:
        ids = tokenizer.completion_ids(body["prompt"])
    return tuple(block_hashes(ids, block_size, salt))


def usable_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks of a prompt that may be served from a cache: the last prompt token is always computed (vLLM
    recomputes it even on a full hit), so a prompt that is whole blocks can reuse one block less."""
    return max(0, (prompt_tokens - 1) // block_size)


class PrefixIndex:
    """Which backend probably holds which blocks: the *approximate* index (learned from what was dispatched,
    corrected by what backends report), or fed by KV events (*precise*). Pure: no I/O, time passed in.

    Per backend, an LRU of block hashes sized to its KV capacity in blocks; a block not touched for ``ttl_s``
    is taken as evicted. ``match`` walks a prompt's chain and stops at the first block the backend lacks.
    """

    def __init__(self, block_size: int = 16, ttl_s: float | None = None, default_capacity: int = 65_536,
                 precise: bool = False):
        self.block_size = block_size
        self.precise = precise  # fed by the backends' KV events: a dispatch is not a store, and nothing expires
        self.ttl_s = ttl_s
        self.default_capacity = default_capacity
        # block → (last use, chain's root, depth in that chain; -1 if unknown)
        self._blocks: dict[str, OrderedDict[int, tuple[float, int, int]]] = {}
        self._capacity: dict[str, int] = {}
        self.inserted = 0
        self.evicted = 0
        self._latest = float("-inf")  # the latest time a caller passed: an insert never goes back before it
        # called with (backend, root, affects) when blocks of a chain starting at ``root`` appear on or leave
        # that backend ((backend, None, None) when it lost everything): what a scheduler that remembers matches
        # must forget. ``affects(blocks, matched_tokens)``, or None for all, says which chains' matches may
        # have moved.
        self.listeners: list[Callable[[str, int | None, Affects | None], None]] = []

    def _changed(self, backend: str, root: int | None, affects: Affects | None = None) -> None:
        for listener in self.listeners:
            listener(backend, root, affects)

    def _added(self, added: set[int]) -> Affects:
        """A match can grow only where it stops: at a block just added (or just refreshed past its TTL)."""
        bs = self.block_size

        def affects(blocks: Sequence[int], matched: int) -> bool:
            k = matched // bs
            return k < len(blocks) and blocks[k] in added
        return affects

    def _removed(self, depth: int) -> Affects:
        """A match shrinks only if it reached past the shallowest block removed."""
        bs = self.block_size
        return lambda _blocks, matched: matched // bs > depth

    def __len__(self) -> int:
        return sum(len(b) for b in self._blocks.values())

    def backends(self) -> list[str]:
        return list(self._blocks)

    def size(self, backend: str) -> int:
        return len(self._blocks.get(backend, ()))

    def set_capacity(self, backend: str, blocks: int) -> None:
        self._capacity[backend] = max(1, int(blocks))
        self._trim(backend)

    def match(self, blocks: Sequence[int], backend: str, now: float | None = None) -> int:
        """Leading blocks of ``blocks`` the backend probably holds (not touched: a lookup is not a use).

        What the index keeps of a chain is a prefix of it (inserted leaf first, evicted leaves first, a root
        used at least as recently as anything below it), so the match is found by bisection: O(log n) lookups.
        Blocks removed out of order (a KV event) can make that an approximation, never an error."""
        held = self._blocks.get(backend)
        if not held or not blocks:
            return 0
        if now is not None and now > self._latest:
            self._latest = now
        stale = None if self.ttl_s is None or now is None or self.precise else now - self.ttl_s
        lo, hi = 0, len(blocks)  # blocks[:lo] are held; blocks[hi:] are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            t = held.get(blocks[mid - 1])
            if t is None or stale is not None and t[0] < stale:
                hi = mid - 1
            else:
                lo = mid
        return lo

    def cached_tokens(self, blocks: Sequence[int], prompt_tokens: int, backend: str,
                      now: float | None = None) -> int:
        """Prompt tokens the backend probably serves from its cache (whole blocks, the last token computed)."""
        bs = self.block_size
        return self.match(blocks[:max(0, (prompt_tokens - 1) // bs)], backend, now) * bs  # usable_blocks, inlined

    def match_all(self, blocks: Sequence[int], backends: Iterable[str], now: float | None = None) -> dict[str, int]:
        return {b: self.match(blocks, b, now) for b in backends}

    def insert(self, blocks: Sequence[int], backend: str, now: float = 0.0, root: int | None = None) -> None:
        """The backend computed (or will compute) these blocks: they become its most recently used, the
        first block last, so that what the index keeps of a chain is always a prefix of it. ``root``: the
        chain's first block, when ``blocks`` continue a chain (a KV event stores a prompt's new tail)."""
        if not blocks:
            return
        held = self._blocks.setdefault(backend, OrderedDict())
        continued, root = root is not None, blocks[0] if root is None else root
        now = self._latest = max(now, self._latest)  # a match may already have read a later clock: blocks
        stale = None if self.ttl_s is None or self.precise else now - self.ttl_s  # it saw as expired count so
        added: set[int] = set()
        depths = repeat(-1) if continued else range(len(blocks) - 1, -1, -1)
        # the chain's root ends most recent: LRU evicts leaves first, as vLLM does
        for h, entry in zip(reversed(blocks), zip(repeat(now), repeat(root), depths)):
            if h in held:
                held.move_to_end(h)
                if stale is not None and held[h][0] < stale:
                    added.add(h)  # it counted as gone (TTL): matches through it grow back
            else:
                self.inserted += 1
                added.add(h)
            held[h] = entry
        if added:  # a continued chain's depths are unknown: every match under its root may have moved
            self._changed(backend, root, None if continued else self._added(added))
        self._trim(backend)

    def remove(self, blocks: Iterable[int], backend: str) -> None:
        """The backend evicted these blocks (a KV event, or a response that reported fewer cached tokens)."""
        held = self._blocks.get(backend)
        if held:
            roots: dict[int, int] = {}  # root → the shallowest depth removed under it
            for h in blocks:
                if (entry := held.pop(h, None)) is not None:
                    self.evicted += 1
                    if entry[2] < roots.get(entry[1], _DEEPEST):
                        roots[entry[1]] = entry[2]
            self._removals(backend, roots)

    def _removals(self, backend: str, roots: dict[int, int]) -> None:
        for root, depth in roots.items():
            self._changed(backend, root, None if depth < 0 else self._removed(depth))

    def clear(self, backend: str) -> None:
        self.evicted += len(self._blocks.pop(backend, ()))
        self._changed(backend, None)

    def _trim(self, backend: str) -> None:
        held = self._blocks.get(backend)
        if held is None:
            return
        limit = self._capacity.get(backend, self.default_capacity)
        roots: dict[int, int] = {}
        while len(held) > limit:
            _, (_, root, depth) = held.popitem(last=False)
            if depth < roots.get(root, _DEEPEST):
                roots[root] = depth
            self.evicted += 1
        self._removals(backend, roots)
