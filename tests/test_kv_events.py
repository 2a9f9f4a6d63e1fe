"""The precise prefix index: vLLM's KV events (the wire format vLLM publishes) folded into the gateway's own
block hashes, and, live, the gateway following the emulated vLLM's events over ZMQ."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from fairgate.accounting.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventFold, KVEventBatch,
                                           decode, encode)
from fairgate.accounting.prefix import PrefixIndex, block_hashes
from tests.conftest import gateway_config, run_gateway

BS = 16


def _vllm_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """An engine's own block hash (vLLM's are sha256 over its own serialisation): nothing like ours."""
    return hashlib.sha256((parent or b"root") + repr(tokens).encode()).digest()


def _stored(ids: list[int], salt: str | None, start: int = 0, parent: bytes | None = None) -> tuple[BlockStored, list[bytes]]:
    hashes, p = [], parent
    for i in range(start, len(ids) // BS):
        p = _vllm_hash(p, ids[i * BS:(i + 1) * BS])
        hashes.append(p)
    keys = [[salt] if salt and start == 0 else None] + [None] * (len(hashes) - 1)
    return BlockStored(hashes, parent, ids[start * BS:len(hashes) * BS + start * BS], BS, None, "GPU", None,
                       keys if salt and start == 0 else None), hashes


def _deliver(fold: EventFold, seq: int, *events) -> int:
    frames = encode(KVEventBatch(0.0, list(events)), seq)
    fold.receive(*decode(frames), now=0.0)
    return seq + 1


def test_stored_events_index_the_blocks_under_the_gateways_hashes_and_the_tenants_salt():
    index = PrefixIndex(BS, precise=True)
    fold = EventFold(index, "w0")
    ids = list(range(5 * BS + 3))  # 5 whole blocks and a tail the engine does not store
    head, engine = _stored(ids[:3 * BS], "tenant-a")
    seq = _deliver(fold, 0, head)
    tail, _ = _stored(ids[:5 * BS], None, start=3, parent=engine[-1])  # the prompt's new blocks, chained on
    seq = _deliver(fold, seq, tail)
    ours = block_hashes(ids, BS, "tenant-a")
    assert index.match(ours, "w0") == 5
    assert index.match(block_hashes(ids, BS, "tenant-b"), "w0") == 0  # another salt never matches
    assert index.match(block_hashes(ids, BS, None), "w0") == 0
    seq = _deliver(fold, seq, BlockRemoved([engine[2]], "GPU"))  # the engine evicted the third block
    assert index.match(ours, "w0") == 2
    seq = _deliver(fold, seq, AllBlocksCleared())
    assert index.match(ours, "w0") == 0 and index.size("w0") == 0


def test_a_lost_message_clears_the_backend_rather_than_trust_a_stale_view():
    index = PrefixIndex(BS, precise=True)
    fold = EventFold(index, "w0")
    ids = list(range(4 * BS))
    stored, _ = _stored(ids, None)
    _deliver(fold, 7, stored)
    assert index.match(block_hashes(ids, BS), "w0") == 4
    _deliver(fold, 9, BlockRemoved([b"unknown"], "GPU"))  # message 8 never came
    assert fold.gaps == 1 and index.size("w0") == 0
    orphan, _ = _stored(ids, None, start=2, parent=b"never-seen")
    _deliver(fold, 10, orphan)
    assert fold.unchained == 2 and index.size("w0") == 0  # blocks whose chain we cannot name are not guessed


def test_malformed_messages_are_refused():
    for frames in ([b"x"], [b"", b"\x00" * 8, b"\xc1"], [b"", b"\x00" * 7, b""], [b"", b"\x00" * 8, b"\x92\x01\x91\x01"]):
        with pytest.raises(ValueError):
            decode(frames)


async def _quiet(gw, emulators) -> None:
    """Until every event the emulators published has been folded."""
    sub = gw.gateway.kv_events
    for _ in range(200):
        if all(sub.folds[f"emulated-{i}"].last_seq == e.server.kv_events.seq - 1 for i, e in enumerate(emulators)
               if e.server.kv_events.seq):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the KV events did not arrive")


@pytest.mark.parametrize("tokenize", ["gateway", "backend"])
async def test_the_precise_index_follows_the_emulated_vllms_kv_events(sqlite_url, tokenize):
    """Over two emulated backends that publish KV events (small caches, so they evict), the gateway's index
    holds exactly the blocks each engine holds, and predicts the cached tokens each response reports, with
    prompts tokenized by the gateway or by the backend's /tokenize."""
    cfg = gateway_config(sqlite_url, policy="dlpm", locality={"index": "precise", "tokenize": tokenize},
                         emulated={"count": 2, "kv_tokens": 1_600})
    async with run_gateway(cfg) as gw:
        emulators = gw.gateway.emulators
        assert gw.gateway.live.index.precise and all(e.server.kv_events for e in emulators)
        client = gw.client(await gw.key("docs", user="u"))
        docs = [f"Document {d}: " + " ".join(f"word{d}x{i}" for i in range(200)) for d in range(6)]

        async def ask(doc: str, n: int) -> None:
            await client.chat.completions.create(model="sim-llama", max_tokens=4, messages=[
                {"role": "system", "content": doc}, {"role": "user", "content": f"question {n}"}])

        for round_ in range(3):  # 6 documents of ~600 tokens, 2 caches of 100 blocks: evictions
            await asyncio.gather(*(ask(doc, round_ * 10 + k) for k, doc in enumerate(docs)))
            await _quiet(gw, emulators)
            for i, e in enumerate(emulators):
                engine_blocks = set(e.server.runner.engine.cache._lru)
                assert set(gw.gateway.live.index._blocks.get(f"emulated-{i}", ())) == engine_blocks
        assert gw.gateway.live.index.evicted > 0  # the engines evicted, and the index followed
        # asked one at a time, with the index quiet, the prediction is what the backend then reports
        for k, doc in enumerate(docs[:3]):
            await ask(doc, 100 + k)
            await _quiet(gw, emulators)
        rows = (await gw.rows())[-3:]
        assert all(r["predicted_cached_tokens"] == r["cached_tokens"] for r in rows), rows
        assert sum(f.gaps for f in gw.gateway.kv_events.folds.values()) == 0
