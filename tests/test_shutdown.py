"""SIGTERM under load: `fairgate serve` stops accepting, lets open streams finish for `drain_s`,
then cancels what is left; either way every request leaves its usage row — written before the process exits,
or journaled and written at the next start."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import aiohttp
import pytest

from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.identity import Admin
from tests.conftest import free_port, gateway_config, run_gateway, usage_rows, wait_until_up

pytestmark = pytest.mark.slow
STREAMS = 100


async def _serve(tmp_path, drain_s: float, extra: str = "", db: str | None = None
                 ) -> tuple[subprocess.Popen, str, str, str]:
    db = db or f"sqlite:///{tmp_path}/fairgate.db"
    engine = make_engine(db)
    await ensure_schema(engine)
    admin = Admin(sessionmaker(engine))
    await admin.create_app("load")
    key = (await admin.create_key("load"))["key"]
    await engine.dispose()
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"port: {port}\ndatabase_url: {db}\ndrain_s: {drain_s}\nusage_journal: {tmp_path}/journal\n"
                      "emulated: {count: 2, speed: 2.0, kv_tokens: 40000}\n"
                      "access_log: false\n" + extra)  # stderr is a pipe read at the end: no line per request
    url = f"http://127.0.0.1:{port}"
    return await _start(config, url), url, key, db


async def _start(config, url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--config", str(config)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await wait_until_up(url + "/ready", proc, pause_s=0.1)
    return proc


async def _open_streams(url: str, key: str, max_tokens: int) -> tuple[list, asyncio.Event]:
    """STREAMS streaming requests; each reports (got [DONE], events) when its stream ends."""
    started = asyncio.Event()
    opened = [0]

    async def one(s: aiohttp.ClientSession) -> tuple[bool, int]:
        body = {"model": "sim-llama", "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        events, done = 0, False
        try:
            async with s.post(url + "/v1/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {key}"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        if events == 0:
                            opened[0] += 1
                            if opened[0] == STREAMS:
                                started.set()
                        events += 1
                        done = done or line.strip() == b"data: [DONE]"
        except aiohttp.ClientError:
            pass
        return done, events

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    tasks = [asyncio.create_task(one(session)) for _ in range(STREAMS)]
    return [session, tasks], started


@pytest.mark.parametrize("drain_s,finished", [(60.0, True), (0.5, False)])
async def test_sigterm_with_100_streams_open_leaves_every_row(tmp_path, drain_s, finished):
    proc, url, key, db = await _serve(tmp_path, drain_s)
    try:
        (session, tasks), started = await _open_streams(url, key, max_tokens=150)
        await asyncio.wait_for(started.wait(), 60)
        proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*tasks)
        await session.close()
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = await usage_rows(db)
    # every stream's row is in the database before the process exits (not left in the journal for the next start)
    assert len(rows) == STREAMS, [ln for ln in proc.stderr.read().decode().splitlines() if "INFO" not in ln][:12]
    if finished:  # drained: every stream ran to its end
        assert all(done for done, _ in results) and {r["status"] for r in rows} == {"ok"}
        assert all(r["completion_tokens"] == 150 for r in rows)
    else:  # cut after the drain: each cancelled stream is charged what it generated
        assert any(not done for done, _ in results) and "cancelled" in {r["status"] for r in rows}


async def test_the_listener_bounds_connections_header_and_body_time(tmp_path):
    """A slowloris (headers that never finish), a body that never finishes, and more connections than allowed:
    each is cut, and the gateway keeps answering."""
    proc, url, key, db = await _serve(tmp_path, 5.0, "header_timeout_s: 1\nbody_timeout_s: 1\nmax_connections: 8\n")
    host, port = url.split("//")[1].split(":")
    try:
        slow_r, slow_w = await asyncio.open_connection(host, int(port))
        slow_w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        body_r, body_w = await asyncio.open_connection(host, int(port))
        body_w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                     + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        assert await asyncio.wait_for(slow_r.read(), 5) == b""  # closed by the server within the timeout
        answer = await asyncio.wait_for(body_r.read(4096), 5)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer
        held = [await asyncio.open_connection(host, int(port)) for _ in range(8)]
        extra_r, _ = await asyncio.open_connection(host, int(port))
        assert await asyncio.wait_for(extra_r.read(), 5) == b""  # the ninth is closed at once
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
    rows = await usage_rows(db)
    assert [(r["status"], r["http_status"]) for r in rows] == [("rejected", 408)]


async def _answers(s: aiohttp.ClientSession, url: str, key: str, received: list[str], stop: asyncio.Event,
                   answered: asyncio.Event | None = None) -> None:
    """One client streaming short answers until ``stop`` (or the gateway dies), each with its own x-request-id;
    the ids of the answers it received in full (their [DONE]) go to ``received``, and ``answered`` is set."""
    import uuid

    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "go"}], "max_tokens": 8,
            "stream": True, "ignore_eos": True}
    while not stop.is_set():
        rid = uuid.uuid4().hex
        try:
            async with s.post(url + "/v1/chat/completions", json=body, headers={
                    "Authorization": f"Bearer {key}", "x-request-id": rid}) as r:
                done = False
                async for line in r.content:
                    done = done or line.strip() == b"data: [DONE]"
                if done:
                    received.append(rid)
                    if answered is not None:
                        answered.set()
        except aiohttp.ClientError:
            return


async def test_sigkill_under_load_loses_no_row_of_an_answer_its_client_received(tmp_path, db_url):
    """`kill -9` (an OOM kill, a node eviction) under 32 clients streaming short answers, then a start on the
    same database and port: every answer a client received in full has exactly one row (by its x-request-id):
    the rows of the last fraction of a second, in memory when the process died, come back from the journal."""
    proc, url, key, db = await _serve(tmp_path, 30.0, db=db_url)
    received: list[str] = []

    try:
        # killed as an answer reaches its client (its row journaled, and most likely not yet written); the
        # emulated backends end the 32 streams in waves, and a kill that found the journal empty (between two
        # waves, the last one written) proves nothing: then again
        for attempt in range(3):
            if attempt:
                proc = await _start(tmp_path / "fairgate.yaml", url)
            stop, answered = asyncio.Event(), asyncio.Event()
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                clients = [asyncio.create_task(_answers(s, url, key, received, stop, answered)) for _ in range(32)]
                await asyncio.sleep(4.0)
                answered.clear()
                await answered.wait()
                proc.kill()  # SIGKILL: no drain, no flush
                await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
                stop.set()
                await asyncio.gather(*clients)
            proc = await _start(tmp_path / "fairgate.yaml", url)  # the same database and port: its journal
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
            log = proc.stderr.read().decode()
            if "recovered from the journal" in log:
                break
        assert len(received) > 100
    finally:
        if proc.poll() is None:
            proc.kill()
    rows = await usage_rows(db)
    ids = [r["client_request_id"] for r in rows]
    missing = set(received) - set(ids)
    # (without the journal 32-62 are missing; with a stream's last events written before its row was
    # journaled, 1 in one run of four)
    assert not missing and len(ids) == len(set(ids)), (len(missing), len(ids) - len(set(ids)))
    assert "recovered from the journal" in log, log[-2000:]


async def test_a_dead_gateways_journal_is_recovered_by_one_command(tmp_path):
    """`fairgate usage recover PATH` writes what a killed gateway's journal holds (another host's, say), once
    (rows the database already holds are skipped), and refuses while that gateway still runs."""
    proc, url, key, db = await _serve(tmp_path, 30.0)
    journal = f"{tmp_path}/journal"
    try:
        async with aiohttp.ClientSession() as s:
            for k in range(5):
                async with s.post(url + "/v1/chat/completions", headers={
                        "Authorization": f"Bearer {key}", "x-request-id": f"r{k}"},
                        json={"model": "sim-llama", "messages": [{"role": "user", "content": "go"}],
                              "max_tokens": 4}) as r:
                    assert r.status == 200
        busy = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "usage", "recover", journal,
                               "--database-url", db], capture_output=True, text=True, timeout=60)
        assert busy.returncode == 1 and "another gateway" in busy.stderr
        proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
    import orjson

    from fairgate.proxy.call import Call
    from fairgate.storage.usage_journal import Journal

    j = Journal(journal)  # as the killed gateway left it, with three rows its writer had not taken yet
    for k in range(5, 8):
        j.append(orjson.dumps(Call(f"late-{k}", "chat", app="load", client_request_id=f"r{k}").row(),
                              default=str) + b"\n")
    j.close()
    out = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "usage", "recover", journal,
                          "--database-url", db], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "rows recovered" in out.stdout, out.stderr
    rows = await usage_rows(db)
    assert sorted(r["client_request_id"] for r in rows) == [f"r{k}" for k in range(8)]
    again = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "usage", "recover", journal,
                            "--database-url", db], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to recover" in again.stdout


async def test_sigkill_while_postgres_is_away_loses_no_row_once_it_returns(tmp_path, pg_url):
    """PostgreSQL cut under load (rows wait in the journal), then the gateway killed; the database back, a
    start on the same journal: every answer a client received in full has exactly one row."""
    from tests.tcp_proxy import TcpProxy

    proxy = await TcpProxy("127.0.0.1", 5432).start()
    proc, url, key, db = await _serve(tmp_path, 30.0, db=pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    received: list[str] = []
    stop = asyncio.Event()

    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            clients = [asyncio.create_task(_answers(s, url, key, received, stop)) for _ in range(16)]
            await asyncio.sleep(2.0)
            await proxy.cut()  # the database gone: the gateway serves on (its key is cached) and journals
            before = len(received)
            await asyncio.sleep(2.0)
            assert len(received) > before + 20
            proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
            stop.set()
            await asyncio.gather(*clients)
        await proxy.start()  # the database back
        proc = await _start(tmp_path / "fairgate.yaml", url)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        await proxy.cut()
    rows = await usage_rows(pg_url)
    ids = [r["client_request_id"] for r in rows]
    missing = set(received) - set(ids)
    # (without the journal 32-62 are missing; with a stream's last events written before its row was
    # journaled, 1 in one run of four)
    assert not missing and len(ids) == len(set(ids)), (len(missing), len(ids) - len(set(ids)))


async def test_an_answer_the_gateway_cuts_at_the_drain_s_end_is_not_billed_as_its_client_leaving(sqlite_url):
    """A request answered whole that the gateway cancels when ``drain_s`` is over: nobody chose that moment, and
    nothing was answered, so it is billed its prompt and no output, not the whole max_tokens a client that
    leaves is billed (it may have generated all of it); its row says the gateway stopped it."""
    cfg = gateway_config(sqlite_url, drain_s=0.3, emulated={"speed": 1.0})
    async with run_gateway(cfg) as gw:
        key = await gw.key()

        async def ask() -> None:
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
                async with s.post(gw.url + "/v1/chat/completions", json={
                        "model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}) as r:
                    await r.read()

        asking = asyncio.create_task(ask())
        while not any(b.inflight for b in gw.gateway.pool.backends):  # (running on a backend)
            await asyncio.sleep(0.02)
    with pytest.raises(aiohttp.ClientError):
        await asking
    [row] = await usage_rows(sqlite_url)
    assert (row["status"], row["http_status"]) == ("cancelled", 503) and "drain_s" in row["error"]
    assert row["completion_tokens"] == 0 and row["prompt_tokens"] > 0
