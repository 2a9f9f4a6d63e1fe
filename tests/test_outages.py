"""The database goes away and comes back: requests keep being served, every usage row waits in the
usage journal and reaches the database in order when it returns — or at the next start if the gateway stopped
meanwhile. PostgreSQL is real, reached through a proxy the test cuts. Redis too: the gateway serves on,
but is not ready while its shared state is out of sync."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid

import openai
import pytest

from tests.conftest import PG_SERVER, gateway_config, run_gateway, usage_rows
from tests.tcp_proxy import TcpProxy

MSGS = [{"role": "user", "content": "hi"}]


def _via(url: str, proxy: TcpProxy) -> str:
    return url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")


async def test_postgres_down_under_load_loses_no_row(pg_url, tmp_path):
    assert "127.0.0.1:5432" in PG_SERVER
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    cfg = gateway_config(_via(pg_url, proxy), usage_journal=str(tmp_path / "journal"), identity_cache_ttl_s=0.5)
    async with run_gateway(cfg) as gw:
        clients = [gw.client(await gw.key("load", user=f"u{i}")) for i in range(4)]
        sent, failed, answered, stop = [0], [], set(), asyncio.Event()

        async def user(c: openai.AsyncOpenAI) -> None:
            while not stop.is_set():
                sent[0] += 1
                try:
                    await c.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=3)
                    answered.add(id(c))
                except openai.APIError as e:
                    failed.append(e)

        tasks = [asyncio.create_task(user(c)) for c in clients]
        await asyncio.sleep(0.5)
        for _ in range(100):  # (every key known before the cut: on a busy machine a first answer can take longer)
            if len(answered) == len(clients):
                break
            await asyncio.sleep(0.05)
        await proxy.cut()  # the database is gone: keys come from the (stale) cache, rows wait in the journal
        await asyncio.sleep(3.0)
        journaled = gw.gateway.writer.on_disk
        await proxy.start()  # back, on the same port
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        assert await gw.gateway.writer.flush()
        assert gw.gateway.writer.pending == 0
    rows = await usage_rows(pg_url)
    assert not failed and journaled > 0
    assert len(rows) == sent[0] and all(r["status"] == "ok" for r in rows)
    finished = [r["finished_at"] for r in sorted(rows, key=lambda r: r["id"])]
    assert finished == sorted(finished)  # in the order they were queued: the journal first, then what came after


async def test_rows_journaled_at_shutdown_are_written_at_the_next_start(pg_url, tmp_path):
    journal = str(tmp_path / "journal")
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    cfg = gateway_config(_via(pg_url, proxy), usage_journal=journal, usage_flush_at_stop_s=0.5)
    async with run_gateway(cfg) as gw:
        client = gw.client(await gw.key())
        await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=2)  # the key is known
        assert await gw.gateway.writer.flush()
        await proxy.cut()
        for _ in range(5):
            await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=2)
    assert len(await usage_rows(pg_url)) == 1  # the other five are in the journal
    async with run_gateway(gateway_config(pg_url, usage_journal=journal)) as gw:
        for _ in range(50):
            if gw.gateway.writer.pending == 0:
                break
            await asyncio.sleep(0.1)
    rows = await usage_rows(pg_url)
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)


@pytest.fixture(autouse=True)
def _quiet_pool_errors(caplog):
    caplog.set_level("CRITICAL", logger="sqlalchemy.pool")


async def test_a_journaled_batch_that_did_reach_the_database_is_not_written_twice(sqlite_url, tmp_path):
    """The commit of a batch can succeed while its answer is lost; the batch stays in the journal and is
    written again, and that must not duplicate it (request ids are the gateway's own)."""
    import orjson

    from fairgate.storage.usage_journal import Journal
    from fairgate.storage.usage_writer import UsageWriter

    async with run_gateway(gateway_config(sqlite_url)) as gw:
        client = gw.client(await gw.key())
        for _ in range(3):
            await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=2)
        written = await gw.rows()
        (tmp_path / "journal.0").write_bytes(b"".join(  # as if the answer was lost
            orjson.dumps({k: v for k, v in r.items() if k != "id"}) + b"\n" for r in written))
        writer = UsageWriter(gw.gateway.sessions, journal=(journal := Journal(tmp_path / "journal")))
        await writer.start()
        assert writer.pending == 0 and not journal.segments()[:-1]
        await writer.close()
        assert len(await gw.rows()) == 3 and not journal.segments()


async def test_redis_away_makes_the_gateway_unready_but_costs_no_request(sqlite_url, caplog):
    """Redis goes away and comes back: /ready 503 with the reason (operators), the gauge at 0, one warning in
    the log (not one a sync), completions served all along on local counters; then 200 and the gauge at 1."""
    import aiohttp

    caplog.set_level("INFO", logger="fairgate.shared")
    proxy = await TcpProxy("127.0.0.1", 6379).start()
    ops = {"Authorization": "Bearer ops"}
    cfg = gateway_config(sqlite_url, redis_url=f"redis://127.0.0.1:{proxy.port}/0", ops_token="ops",
                         redis_namespace=f"t{uuid.uuid4().hex[:8]}")

    async def state(s: aiohttp.ClientSession) -> tuple[int, list[str], str]:
        async with s.get(gw.url + "/ready", headers=ops) as r:
            ready = r.status, (await r.json())["reasons"]
        async with s.get(gw.url + "/metrics", headers=ops) as r:
            lines = (await r.text()).splitlines()
            gauge = next(x for x in lines if x.startswith("fairgate_shared_state_up "))
        return *ready, gauge.split()[1]

    async with run_gateway(cfg) as gw, aiohttp.ClientSession() as s:
        client = gw.client(await gw.key())
        assert await state(s) == (200, [], "1.0")
        await proxy.cut()
        await asyncio.sleep(0.3)  # many failed syncs
        status, reasons, up = await state(s)
        assert status == 503 and up == "0.0" and len(reasons) == 1 and reasons[0].startswith("shared state: ")
        await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=2)  # served
        await proxy.start()
        await asyncio.sleep(0.3)
        assert await state(s) == (200, [], "1.0")
        await gw.gateway.shared.redis.delete(*gw.gateway.shared.keys)
    said = [r.getMessage() for r in caplog.records if r.name == "fairgate.shared"]
    assert len([m for m in said if "not ready until Redis answers" in m]) == 1, said
    assert sum("Redis answers again" in m for m in said) == 1, said


def test_an_unresolvable_redis_host_is_said_once_not_a_traceback_per_attempt(tmp_path):
    """`fairgate serve` with a Redis URL whose host does not resolve (a typo in a compose file): it serves on
    this replica's counters and says so, once, without a traceback for each lookup its connection attempts
    left behind."""
    env = {**os.environ, "FAIRGATE_HOME": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--port", "0", "--redis-url",
                             "redis://redis-cache.invalid:6379/0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=8)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=40)
    assert "not ready until Redis answers" in out, out
    assert "never retrieved" not in out and "Traceback" not in out, out
