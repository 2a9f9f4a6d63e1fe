"""vLLM's KV-cache events as the prefix index's *precise* source (`--kv-events-config`, ZMQ publisher). Pure.

The wire format is vLLM's (``vllm/distributed/kv_events.py``): a multipart message ``[topic, seq, payload]``,
``seq`` an 8-byte big-endian counter, ``payload`` a msgpack ``KVEventBatch`` ``[ts, events, dp_rank]`` of tagged
events (maps with a ``type`` key since vLLM's events grew optional fields; arrays before):
``BlockStored`` (full blocks newly cached: their hashes, the parent block's hash, their token ids, the block
size, LoRA, medium, and per block the ``extra_keys`` that entered its hash: the ``cache_salt`` on a chain's
first block), ``BlockRemoved`` and ``AllBlocksCleared``. The emulated vLLM publishes the same messages.

An engine's block hashes are its own (vLLM's sha256 over its tokenizer's ids), so ``EventFold`` re-derives
the gateway's hash of every stored block from its parent's and its token ids (``accounting/prefix.py``'s
chain, seeded by the salt the first block's ``extra_keys`` carry) and keeps engine hash → ours to apply
removals. A request then matches what a backend really holds when the gateway hashes the same token ids the
engine saw: exact for the emulator (same tokenizer); for a real model, the gateway must tokenize with the
model's tokenizer and chat template (``locality.tokenize: backend`` asks the backend's ``/tokenize``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence, Union

import msgspec

from fairgate.accounting.prefix import PrefixIndex, salt_seed

EngineHash = Union[int, bytes]


class BlockStored(msgspec.Struct, tag=True):  # every field written: vLLM requires lora_id, medium, lora_name
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None  # per block: what else entered its hash (cache_salt, ...)


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]
_EVENTS = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(batch: KVEventBatch, seq: int, topic: bytes = b"") -> list[bytes]:
    """As vLLM 0.32 publishes: events as maps tagged ``type`` (earlier releases sent tagged arrays)."""
    return [topic, seq.to_bytes(8, "big", signed=True), _encoder.encode(batch)]


def _event(raw: Any) -> Event | None:
    """One event, map-tagged (vLLM ≥ 0.11) or array-tagged (earlier); fields we do not read are ignored;
    None for an event type we do not know (a newer vLLM's)."""
    if isinstance(raw, dict):
        cls = _EVENTS.get(raw.get("type"))
        fields = {k: v for k, v in raw.items() if cls is not None and k in cls.__struct_fields__}
    elif isinstance(raw, list) and raw:
        cls = _EVENTS.get(raw[0])
        fields = dict(zip(cls.__struct_fields__, raw[1:])) if cls is not None else {}
    else:
        raise ValueError("an event is neither a map nor an array")
    return None if cls is None else msgspec.convert(fields, cls)


def decode(frames: Sequence[bytes]) -> tuple[int, KVEventBatch]:
    """``(seq, batch)`` of one published message; raises ``ValueError`` on anything else."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError("not a KV event message: expected [topic, seq, payload]")
    try:
        raw = msgspec.msgpack.decode(frames[2])
        if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
            raise ValueError("not a KV event batch: expected [ts, events, ...]")
        events = [e for e in map(_event, raw[1]) if e is not None]
        return int.from_bytes(frames[1], "big", signed=True), KVEventBatch(float(raw[0]), events)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"not a KV event batch: {e}") from e


def stored_salt(event: BlockStored) -> str | None:
    """The cache salt of a chain's first block: the last string of its ``extra_keys`` (vLLM appends the salt
    after any LoRA name and multimodal identifiers)."""
    keys = event.extra_keys[0] if event.extra_keys else None
    strings = [k for k in keys or () if isinstance(k, str)]
    return strings[-1] if strings else None


class EventFold:
    """One backend's event stream applied to the prefix index, in the gateway's own block hashes."""

    def __init__(self, index: PrefixIndex, backend: str, max_blocks: int = 1 << 20):
        self.index, self.backend, self.max_blocks = index, backend, max_blocks
        self._ours: OrderedDict[EngineHash, tuple[int, int]] = OrderedDict()  # engine hash → (ours, chain root)
        self.last_seq: int | None = None
        self.gaps = 0  # messages lost (the publisher's high-water mark, a restart): the index was cleared
        self.unchained = 0  # stored blocks whose parent we never saw: not indexed

    def receive(self, seq: int, batch: KVEventBatch, now: float) -> None:
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1  # what was lost is unknown: forget this backend rather than trust a stale view
            self._ours.clear()
            self.index.clear(self.backend)
        self.last_seq = seq
        for event in batch.events:
            self.apply(event, now)

    def apply(self, event: Event, now: float) -> None:
        if getattr(event, "medium", None) not in (None, "GPU"):
            return  # an offloading tier's copy (CPU, storage): not what a prefill on this backend reuses
        if isinstance(event, BlockStored):
            self._stored(event, now)
        elif isinstance(event, BlockRemoved):
            ours = [self._ours.pop(h)[0] for h in event.block_hashes if h in self._ours]
            self.index.remove(ours, self.backend)
        else:
            self._ours.clear()
            self.index.clear(self.backend)

    def _stored(self, event: BlockStored, now: float) -> None:
        if event.parent_block_hash is None:
            parent, root = salt_seed(stored_salt(event)), None
        elif (known := self._ours.get(event.parent_block_hash)) is not None:
            parent, root = known
        else:
            self.unchained += len(event.block_hashes)
            return
        size, tokens, chain = event.block_size, event.token_ids, []
        for i, h in enumerate(event.block_hashes):
            block = tokens[i * size:(i + 1) * size]
            if len(block) != size:
                break  # a malformed event: keep what chained
            parent = hash((parent, tuple(block)))
            root = parent if root is None else root
            self._ours[h] = (parent, root)
            chain.append(parent)
        while len(self._ours) > self.max_blocks:
            self._ours.popitem(last=False)
        self.index.insert(chain, self.backend, now, root=root)
