"""Every request, whatever became of it, leaves exactly one usage row with exact tokens — SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from tests.conftest import gateway_config, run_gateway

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello there"}]


async def _give_up(gw, key: str) -> None:
    """A non-streaming client that gives up 0.3 s into a 4,000-token answer."""
    async with aiohttp.ClientSession() as s:
        with pytest.raises(asyncio.TimeoutError):
            async with s.post(gw.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                              timeout=aiohttp.ClientTimeout(total=0.3),
                              json={"model": "sim-llama", "messages": MSGS, "max_tokens": 4000,
                                    "ignore_eos": True}) as r:
                await r.read()


async def _rows(gw, n: int) -> list[dict]:
    for _ in range(200):
        rows = await gw.rows()
        if len(rows) == n:
            break
        await asyncio.sleep(0.02)
    return rows


async def test_one_row_per_request_of_every_kind(db_url):
    async with run_gateway(gateway_config(db_url)) as gw:
        key = await gw.key("billing", user="u1")
        client = gw.client(key)
        ok = await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=4,
                                                  extra_body={"ignore_eos": True})
        stream = await client.completions.create(model="sim-llama", prompt="abc", max_tokens=3, stream=True,
                                                 extra_body={"ignore_eos": True})
        _ = [c async for c in stream]
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="sim-llama", messages=[])
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=MSGS)
        # a client that gives up before the answer (non-streaming, slow output)
        await _give_up(gw, key)
        rows = await _rows(gw, 5)
        assert [r["status"] for r in rows] == ["ok", "ok", "rejected", "rejected", "cancelled"], rows
        assert len({r["request_id"] for r in rows}) == 5
        first = rows[0]
        assert (first["prompt_tokens"], first["completion_tokens"]) == (ok.usage.prompt_tokens, 4)
        assert first["system_tokens"] > 0 and first["user"] == "u1" and first["app"] == "billing"
        assert first["arrival"] <= first["dispatched_at"] <= first["first_token_at"] <= first["finished_at"]
        assert rows[1]["completion_tokens"] == 3 and rows[1]["stream"]
        assert rows[2]["prompt_tokens"] == 0 and rows[2]["http_status"] == 400  # never ran: nothing charged
        cancelled = rows[4]  # a non-streamed answer's count is lost with the connection: billed its reservation
        assert cancelled["completion_tokens"] == 4000 and cancelled["http_status"] == 499


async def test_a_non_streaming_client_that_leaves_is_billed_exactly_with_a_streamed_upstream(sqlite_url):
    """``nonstream_upstream: stream``: the backend streams with running usage even for a non-streaming client,
    so one that gives up is charged what was generated, not its reservation."""
    async with run_gateway(gateway_config(sqlite_url, nonstream_upstream="stream")) as gw:
        key = await gw.key("billing", user="u1")
        ok = await gw.client(key).chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=4,
                                                          extra_body={"ignore_eos": True})
        await _give_up(gw, key)
        rows = await _rows(gw, 2)
        assert ok.usage.completion_tokens == rows[0]["completion_tokens"] == 4
        assert rows[1]["status"] == "cancelled" and 0 < rows[1]["completion_tokens"] < 4000


async def test_rows_survive_a_database_outage(sqlite_url, tmp_path):
    """Rows written behind the hot path are retried, not dropped, when the database refuses them."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        client = gw.client(await gw.key())
        writer = gw.gateway.writer
        real = writer.sessions
        writer.sessions = None  # any write now fails
        for _ in range(3):
            await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=1)
        assert not await writer.flush() and writer.pending == 3
        writer.sessions = real
        assert len(await gw.rows()) == 3


async def test_concurrent_flushes_write_each_row_once(sqlite_url):
    from fairgate.proxy.call import Call
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.usage_queries import rows as all_rows
    from fairgate.storage.usage_writer import UsageWriter

    engine = make_engine(sqlite_url)
    await ensure_schema(engine)
    writer = UsageWriter(sessionmaker(engine), batch_size=7)
    for i in range(50):
        writer.submit(Call(f"r{i}", "chat", app="a").row())
    assert all(await asyncio.gather(*(writer.flush() for _ in range(5))))
    assert sorted(r["request_id"] for r in await all_rows(writer.sessions)) == sorted(f"r{i}" for i in range(50))
    await engine.dispose()
