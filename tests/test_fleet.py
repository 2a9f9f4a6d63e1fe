"""Two gateway processes on one PostgreSQL and one Redis, as a fleet runs them: under steady traffic they cross
several statistics snapshots and a rolling restart (SIGTERM one replica, start it again) with no error in
either log and a usage row for every request either answered."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.identity import Admin
from tests.conftest import (backend_sim_process, free_port, fresh_pg_database, gateway_config, run_gateway, usage_rows,
                            wait_until_up)

pytestmark = pytest.mark.slow
ERROR = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")


class Replica:
    def __init__(self, tmp: Path, name: str, db: str, backend: str, ns: str):
        self.port, self.name = free_port(), name
        self.config = tmp / f"{name}.yaml"
        self.config.write_text(
            f"port: {self.port}\ndatabase_url: {db}\nredis_url: redis://127.0.0.1:6379/0\nredis_namespace: {ns}\n"
            f"policy: fairserve\nbackends: [{{url: '{backend}', name: gpu}}]\nusage_journal: {tmp}/{name}-journal\n"
            "settings_refresh_s: 0.5\nfairserve: {snapshot_s: 0.5}\ndrain_s: 10\n"
            "rpm_limit: 1000000\n")  # OIT's user limit would throttle this one tenant's steady load when busy
        self.log = tmp / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--config",
                                          str(self.config)], stdout=log, stderr=subprocess.STDOUT)
        self.proc.stderr = open(self.log, "rb")  # what wait_until_up shows if it dies
        await wait_until_up(self.url + "/ready", self.proc, tries=400)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(60)
        self.proc.stderr.close()
        return code


async def _traffic(replicas: list[Replica], key: str, stop: asyncio.Event, answered: list[str]) -> int:
    """Requests to the replicas in turn, streamed and not, until ``stop``; the request ids of every answer
    (whatever its status) go into ``answered``. Returns the requests that found no listener (a restart)."""
    refused = 0
    body = {"model": "sim-llama", "messages": [{"role": "user", "content": "hello fleet"}], "max_tokens": 8,
            "ignore_eos": True}
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        i = 0
        while not stop.is_set():
            r = replicas[i % len(replicas)]
            i += 1
            try:
                async with s.post(r.url + "/v1/chat/completions", json={**body, "stream": i % 3 == 0}) as resp:
                    await resp.read()
                    answered.append(resp.headers["x-request-id"])
            except aiohttp.ClientConnectionError:
                refused += 1
                await asyncio.sleep(0.05)
    return refused


async def test_two_replicas_snapshot_and_restart_with_clean_logs_and_every_row(tmp_path):
    async with fresh_pg_database() as db, backend_sim_process("--speed", "50") as (_, backend):
        engine = make_engine(db)
        await ensure_schema(engine)
        admin = Admin(sessionmaker(engine))
        await admin.create_app("fleet")
        key = (await admin.create_key("fleet"))["key"]
        await engine.dispose()
        ns = f"fleet{uuid.uuid4().hex[:8]}"
        a, b = (Replica(tmp_path, n, db, backend, ns) for n in ("a", "b"))
        await asyncio.gather(a.start(), b.start())
        stop, answered = asyncio.Event(), []
        load = asyncio.create_task(_traffic([a, b], key, stop, answered))
        try:
            await asyncio.sleep(3.0)  # several snapshot periods (0.5 s) on both
            assert b.stop() == 0  # the rolling restart: b drains and exits...
            await asyncio.sleep(1.0)
            await b.start()  # ...and comes back on the same port and database
            await asyncio.sleep(3.0)
        finally:
            stop.set()
            refused = await load
            codes = [r.stop() for r in (a, b) if r.proc.poll() is None]
        assert codes == [0, 0]
        rows = await usage_rows(db)
        ids = {r["request_id"] for r in rows}
        assert len(answered) > 100 and set(answered) <= ids and len(rows) == len(answered), (
            len(answered), len(rows), refused)
        assert all(r["status"] == "ok" for r in rows), {r["status"] for r in rows}
        for r in (a, b):
            errors = [line for line in r.log.read_text().splitlines() if ERROR.search(line)]
            assert not errors, f"{r.name}: {errors[:10]}"
        assert "app statistics" in b.log.read_text()  # the restarted replica read the snapshot back


async def test_request_limits_are_shared_by_replicas(tmp_path):
    """With Redis, an app's limit is the fleet's, not each replica's: 4 requests a minute through two
    replicas taking turns are 4, not 8."""
    import uuid

    import openai

    from fairgate.proxy.config import BackendConfig
    from fairgate.engine.serve import start_emulator

    emu = await start_emulator(speed=50.0)
    db, ns = f"sqlite+aiosqlite:///{tmp_path}/fleet.db", f"t{uuid.uuid4().hex[:8]}"
    try:
        cfg = lambda: gateway_config(db, backends=[BackendConfig(url=emu.url, name="gpu")],  # noqa: E731
                                     redis_url="redis://127.0.0.1:6379/0", redis_namespace=ns)
        async with run_gateway(cfg()) as a, run_gateway(cfg()) as b:
            key = await a.key("chat", user="eve")
            await a.admin.set_field("app", "chat", "rpm_limit", 4)
            for gw in (a, b):
                await gw.gateway.tenants.refresh()
            clients = [a.client(key), b.client(key)]
            outcomes = []
            for i in range(8):
                try:
                    await clients[i % 2].chat.completions.create(
                        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
                    outcomes.append("ok")
                except openai.RateLimitError:
                    outcomes.append("limited")
                await asyncio.sleep(0.1)  # past a state sync (20 ms)
            assert outcomes == ["ok"] * 4 + ["limited"] * 4
    finally:
        await emu.stop()
