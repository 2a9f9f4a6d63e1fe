"""A stored conversation's expansion: the time to read a ``previous_response_id`` chain of ``--turns`` turns
(each ~100 words in and ~100 out) from the database and build its whole input, as a follow-up does before it
queues (storage/response_store.py: one recursive query).

    .venv/bin/python bench/responses_chain.py [--turns 50] [--reads 200] [--database-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

from fairgate.proxy.call import utcnow
from fairgate.proxy.pipeline.responses import Conversation
from fairgate.storage.db import make_engine, upgrade
from fairgate.storage.response_store import ResponseStore, new_response_id

WORDS = "the quick brown fox jumps over the lazy dog while the fair queue serves every tenant in turn " * 6


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=50)
    ap.add_argument("--reads", type=int, default=200)
    ap.add_argument("--database-url", default=None)
    args = ap.parse_args()
    url = args.database_url or f"sqlite:///{tempfile.mkdtemp()}/chain.db"
    engine = make_engine(url)
    await upgrade(engine)
    store = ResponseStore(engine, 86400.0, 10_000)
    app = "bench-" + new_response_id()[-8:]
    previous, chain = None, []
    for k in range(args.turns):
        rid = new_response_id()
        output = [{"type": "message", "id": f"msg_{k}", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": WORDS, "annotations": []}]}]
        await store.save(rid, app, "u", previous, "conv", "gpu-0",
                         [{"type": "message", "role": "user", "content": f"turn {k}: {WORDS}"}], output,
                         {"id": rid, "output": output}, utcnow())
        chain = await store.chain(app, "u", rid, utcnow())
        previous = chain[-1]
    times = []
    for _ in range(args.reads):
        t0 = time.perf_counter()
        turns = await store.chain(app, "u", previous.id, utcnow())
        items = Conversation("resp_x", [{"role": "user", "content": "next"}], turns).expanded()
        times.append((time.perf_counter() - t0) * 1000)
    await engine.dispose()
    times.sort()
    print(f"{args.turns} turns, {len(items)} items, {previous.chain_bytes:,} bytes: expanded in "
          f"{statistics.median(times):.2f} ms median, {times[int(0.99 * len(times)) - 1]:.2f} ms p99 "
          f"({url.split(':')[0]})")


if __name__ == "__main__":
    asyncio.run(main())
