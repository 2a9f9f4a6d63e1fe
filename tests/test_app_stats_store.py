"""The statistics snapshot in SQL is written by every replica: two writers at once must not collide."""

from __future__ import annotations

import asyncio

from fairgate.accounting.app_stats import AppStats
from fairgate.storage import app_stats_store
from fairgate.storage.db import ensure_schema, make_engine, sessionmaker


async def test_two_replicas_write_the_snapshot_at_once_without_a_unique_violation(db_url):
    """On PostgreSQL each writer deleted and re-inserted every row: two at once raised a unique violation on
    app_token_stats (at every graceful stop of `serve --workers 2`). Now the snapshot has one writer at a time."""
    engines = [make_engine(db_url) for _ in range(2)]
    await ensure_schema(engines[0])
    replicas = []
    for _ in engines:
        stats = AppStats()
        for app in ("a", "b", "c"):
            for stage in range(4):
                stats.observe(app, stage, 100, 10, 50, 1_700_000_000.0)
        replicas.append(stats)
    try:
        for _ in range(20):
            written = await asyncio.gather(*(app_stats_store.save(sessionmaker(e), s)
                                             for e, s in zip(engines, replicas)))
            assert written[0] == written[1] >= 12
        loaded = AppStats()
        assert await app_stats_store.load(sessionmaker(engines[0]), loaded) == written[0]
    finally:
        for e in engines:
            await e.dispose()
