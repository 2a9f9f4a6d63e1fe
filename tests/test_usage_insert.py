"""The usage writer's bulk insert stores exactly what an ORM insert of the same rows stores, on SQLite (one JSON
batch statement) and PostgreSQL (one executemany), including the values a hostile client can put in a row."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from sqlalchemy import column, delete, insert, select, table

from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.models import UsageLog
from fairgate.storage.row_fit import Fitter
from fairgate.storage.usage_writer import USAGE_INSERT

T0 = datetime(2026, 11, 24, 1, 2, 3, 456789, tzinfo=timezone.utc)


def rows() -> list[dict]:
    """Rows as the gateway makes them, with what a client can put in them (unfitted)."""
    base = dict(app="app1", interaction="i", stage=0, endpoint="chat", stream=False, prompt_tokens=12,
                system_tokens=0, cached_tokens=0, completion_tokens=64, estimated_prompt_tokens=12, arrival=T0,
                status="ok", http_status=200, attempts=1, client_retry=0)
    return [r for r in (
        {**base, "request_id": "r-1", "user": None, "backend": None, "queue_wait_ms": None},
        {**base, "request_id": "r-2", "user": 'ü 😀 "quoted" \\ back\nslash', "stream": True,
         "dispatched_at": T0 + timedelta(microseconds=1), "first_token_at": T0 + timedelta(seconds=1),
         "finished_at": T0 + timedelta(days=1), "queue_wait_ms": 0.1, "counter_before": 1e300,
         "counter_after": -2.5, "error": '{"json": [1, 2]}', "predicted_cached_tokens": 2**31 - 1},
        # what a client can steer: a header's invalid UTF-8 (aiohttp's surrogate escapes), NUL, huge numbers
        {**base, "request_id": "r-3", "user": "bad\udcff\x00byte", "client_request_id": "x" * 500,
         "prompt_tokens": 10**30, "queue_wait_ms": float("nan"), "interaction": "\ud800"},
    )]


def stored(result) -> list[dict]:
    out = []
    for r in result.scalars():
        d = {c.name: getattr(r, c.name) for c in UsageLog.__table__.columns if c.name != "id"}
        out.append(d)
    return sorted(out, key=lambda d: d["request_id"])


async def orm_then_bulk(db_url: str, batch: list[dict]):
    """``batch`` stored by an ORM insert, then (the table emptied) as the usage writer stores it: what each
    stored, and the request ids in the bulk insert's id order."""
    engine = make_engine(db_url)
    try:
        await ensure_schema(engine)
        sessions = sessionmaker(engine)
        fit = Fitter(UsageLog.__table__)
        async with sessions.begin() as s:
            await s.execute(insert(UsageLog), [fit(r) for r in batch])
        async with sessions() as s:
            expected = stored(await s.execute(select(UsageLog)))
        async with sessions.begin() as s:
            await s.execute(delete(UsageLog))
        async with sessions.begin() as s:
            convert = USAGE_INSERT.converter(engine.dialect)  # fits and converts as the writer queues a row
            await USAGE_INSERT.insert(s, [convert(r) for r in batch])
        async with sessions() as s:
            got = stored(await s.execute(select(UsageLog)))
            order = (await s.execute(select(UsageLog.request_id).order_by(UsageLog.id))).scalars().all()
    finally:
        await engine.dispose()
    return expected, got, order


async def test_a_bulk_batch_stores_what_an_orm_insert_stores(db_url):
    expected, got, _ = await orm_then_bulk(db_url, rows())
    assert got == expected
    assert [r["request_id"] for r in got] == ["r-1", "r-2", "r-3"]
    assert got[1]["user"] == 'ü 😀 "quoted" \\ back\nslash' and got[1]["stream"] is True
    assert got[1]["finished_at"] == T0 + timedelta(days=1) and got[1]["queue_wait_ms"] == 0.1
    assert got[2]["prompt_tokens"] == 2**31 - 1 and got[2]["queue_wait_ms"] is None
    assert got[2]["user"] == "bad?byte" and got[2]["interaction"] == "?"


async def test_rows_of_many_null_shapes_are_stored_as_an_orm_insert_stores_them_in_order(db_url):
    """Rows whose NULL columns differ (on SQLite the NULLs go through the adapter ``make_engine`` registers):
    stored as an ORM insert stores them, in the order given."""
    optional = ["user", "backend", "throttle_reason", "client_request_id", "error", "queue_wait_ms", "slo_class"]
    base = rows()[0]
    batch = []
    for k in range(100):  # 100 of the 128 shapes
        row = {**base, "request_id": f"s-{k:03d}"}
        for bit, name in enumerate(optional):
            row[name] = None if k >> bit & 1 else {"queue_wait_ms": 1.5}.get(name, f"{name}-{k}")
        batch.append(row)
    expected, got, order = await orm_then_bulk(db_url, batch)
    assert got == expected
    assert order == [r["request_id"] for r in batch]


async def test_a_batch_written_again_is_stored_once(db_url):
    """``request_id`` is unique: a batch written a second time (its commit lost to the writer, a journal
    drained twice) adds nothing, and the rows new in it are stored."""
    engine = make_engine(db_url)
    try:
        await ensure_schema(engine)
        sessions = sessionmaker(engine)
        convert = USAGE_INSERT.converter(engine.dialect)
        async with sessions.begin() as s:
            await USAGE_INSERT.insert(s, [convert(r) for r in rows()[:2]])
        async with sessions.begin() as s:
            await USAGE_INSERT.insert(s, [convert(r) for r in rows()])
        async with sessions() as s:
            got = stored(await s.execute(select(UsageLog)))
    finally:
        await engine.dispose()
    assert [r["request_id"] for r in got] == ["r-1", "r-2", "r-3"]


async def test_a_database_holding_duplicate_request_ids_upgrades_keeping_every_row(db_url):
    """Written before request ids were unique, a database may hold a row twice; the upgrade keeps both, the
    later one's request id marked as a copy, and makes the ids unique."""
    from alembic import command

    from fairgate.storage.db import alembic_config, upgrade

    engine = make_engine(db_url)
    try:
        def to_0009(conn):
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0009")

        async with engine.begin() as conn:
            await conn.run_sync(to_0009)
        fit = Fitter(UsageLog.__table__)
        twice = [rows()[0], rows()[1], rows()[0]]
        async with engine.begin() as conn:
            for r in twice:  # (rows of different columns: one by one; of the columns of 0009)
                row = {k: v for k, v in fit(r).items() if k != "reasoning_tokens"}
                await conn.execute(insert(table("usage_log", *(column(k) for k in row))), row)
        assert await upgrade(engine) == "0012"
        async with engine.connect() as conn:
            got = (await conn.execute(select(UsageLog.id, UsageLog.request_id).order_by(UsageLog.id))).all()
    finally:
        await engine.dispose()
    assert [r for _, r in got] == ["r-1", "r-2", f"r-1~dup{got[2][0]}"]

