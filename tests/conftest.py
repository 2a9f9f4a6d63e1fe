"""Shared fixtures: real databases (SQLite file, a fresh PostgreSQL database), a live gateway, and the genuine
vLLM server that the session launches in the background (tests/vllm_server.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import asyncpg
import openai
import pytest

from fairgate.proxy.app import Gateway
from fairgate.proxy.config import GatewayConfig, load_config
from fairgate.storage import usage_queries
from fairgate.storage.db import make_engine, sessionmaker
from fairgate.storage.identity import Admin
from tests import vllm_server

_LAUNCHED = pytest.StashKey[tuple[vllm_server.VLLMServer, ...]]()

PG_SERVER = os.environ.get("FAIRGATE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
_VLLM_MARKS = ("slow", "vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wants_vllm(config: pytest.Config) -> bool:
    """Will this session run the genuine-vLLM tests? Decided before collection (under xdist the controller
    never collects): the mark expression must admit them and the paths must include their module."""
    if os.environ.get("FAIRGATE_TEST_VLLM_URL") or os.environ.get(vllm_server.ENV_LAUNCHED):
        return False  # a server you run yourself, or the one the controller launched for this worker
    if hasattr(config, "workerinput"):
        return False  # an xdist worker: only the controller launches
    expr = config.option.markexpr
    if expr:
        from _pytest.mark.expression import Expression

        if not Expression.compile(expr).evaluate(lambda mark, **_: mark in _VLLM_MARKS):
            return False
    paths = [Path(a.split("::")[0]).resolve() for a in config.args]
    target = Path(vllm_server.__file__).with_name("test_vllm_e2e.py")
    return any(p == target or p in target.parents for p in paths)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Launch the vLLM server now, so its install and boot overlap the rest of the suite (runs before xdist
    starts its workers, which inherit the launched server's address through the environment)."""
    if _wants_vllm(session.config):
        server = vllm_server.VLLMServer.launch(free_port(), *vllm_server.E2E_ARGS, kv_events_port=free_port())
        pooling = vllm_server.VLLMServer.launch_pooling(free_port())
        os.environ[vllm_server.ENV_LAUNCHED] = server.to_env()
        os.environ[vllm_server.ENV_LAUNCHED_POOLING] = pooling.to_env()
        session.config.stash[_LAUNCHED] = (server, pooling)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for server in session.config.stash.get(_LAUNCHED, ()):
        server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Slow modules first, so two xdist workers finish together (the longest work is handed out first); the
    vLLM tests last, so that a server still installing or booting delays nothing else (`make test` runs them
    in a phase of their own: tests/suite.py). The deployment tests (Docker) run only when asked for by their
    mark (`make test-deploy`)."""
    if "deploy" not in (config.option.markexpr or ""):
        deploy = [item for item in items if item.get_closest_marker("deploy") is not None]
        if deploy:
            config.hook.pytest_deselected(items=deploy)
            items[:] = [item for item in items if item.get_closest_marker("deploy") is None]
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is not None,
                                 -MODULE_SECONDS.get(item.path.name, 0),
                                 item.get_closest_marker("slow") is None))


# The longest modules, in seconds of one worker (phase 1 of a clean `make test`, `--durations=0`, summed per
# module): handed out longest first, so that no worker is left alone with a long module at the end.
MODULE_SECONDS = {
    "test_vtc_paper.py": 118, "test_replicas.py": 72, "test_locality_live.py": 64, "test_fair_dispatch.py": 62,
    "test_limits_fleet.py": 43, "test_fairserve_sim.py": 39, "test_fuzz.py": 39, "test_slo_plan.py": 38,
    "test_shutdown.py": 37, "test_sim_exact.py": 34, "test_slo_classes.py": 32, "test_fairserve_gateway.py": 30,
    "test_hotpath_cost.py": 48,
}


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/fairgate.db"


@asynccontextmanager
async def fresh_pg_database() -> AsyncIterator[str]:
    """A brand-new PostgreSQL database on the real server, dropped afterwards."""
    name = f"fairgate_t_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(PG_SERVER)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    try:
        yield PG_SERVER.rsplit("/", 1)[0] + "/" + name
    finally:
        conn = await asyncpg.connect(PG_SERVER)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


@pytest.fixture
async def pg_url() -> AsyncIterator[str]:
    async with fresh_pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
async def db_url(request, tmp_path) -> AsyncIterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/fairgate.db"
    else:
        async with fresh_pg_database() as url:
            yield url


@dataclass
class Harness:
    url: str
    gateway: Gateway
    clients: list = field(default_factory=list)

    @property
    def admin(self) -> Admin:
        return Admin(self.gateway.sessions, actor="test")

    async def key(self, app: str = "app1", user: str | None = None) -> str:
        if app not in {a["name"] for a in await self.admin.list("apps")}:
            await self.admin.create_app(app)
        return (await self.admin.create_key(app, user))["key"]

    def client(self, key: str, **kw: Any) -> openai.AsyncOpenAI:
        kw.setdefault("max_retries", 0)
        client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, **kw)
        self.clients.append(client)
        return client

    async def hang_up_after(self, key: str, body: dict[str, Any], events: int) -> None:
        """Stream a chat completion, read ``events`` SSE events, then drop the connection."""
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.post(self.url + "/v1/chat/completions", json={**body, "stream": True},
                              headers={"Authorization": f"Bearer {key}"}) as r:
                seen = 0
                async for line in r.content:
                    seen += line.startswith(b"data: ")
                    if seen >= events:
                        break
                r.close()

    async def rows(self, **eq: Any) -> list[dict[str, Any]]:
        assert await self.gateway.writer.flush()
        return await usage_queries.rows(self.gateway.sessions, **eq)


@asynccontextmanager
async def run_gateway(config: GatewayConfig) -> AsyncIterator[Harness]:
    async with Gateway.open(config) as gateway:
        edge = gateway.edge()
        harness = Harness(f"http://127.0.0.1:{await edge.start('127.0.0.1', 0)}", gateway)
        try:
            yield harness
        finally:
            for client in harness.clients:
                await client.close()
            await edge.shutdown(config.drain_s)


def gateway_config(database_url: str, **kw: Any) -> GatewayConfig:
    import tempfile

    emulated = {"speed": 50.0, **kw.pop("emulated", {})}
    scratch = Path(tempfile.gettempdir()) / f"fairgate-test-{uuid.uuid4().hex[:12]}"
    kw.setdefault("usage_journal", f"{scratch}-journal")  # never the working directory's
    kw.setdefault("usage_dead_letter", f"{scratch}-dead-letter.jsonl")
    return load_config(None, database_url=database_url, emulated=emulated, **kw)


@pytest.fixture
async def gw(sqlite_url) -> AsyncIterator[Harness]:
    """A gateway on SQLite over two emulated backends running 50x faster than an A10G."""
    async with run_gateway(gateway_config(sqlite_url)) as h:
        yield h


async def wait_until_up(url: str, proc, tries: int = 200, pause_s: float = 0.05) -> None:
    """Poll ``url`` until it answers 200; the process must stay alive meanwhile (else its stderr is shown)."""
    import asyncio

    import aiohttp

    async with aiohttp.ClientSession() as s:
        for _ in range(tries):
            try:
                async with s.get(url) as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            await asyncio.sleep(pause_s)


async def closed_loop(client, model: str, requests: int, concurrency: int, max_tokens: int,
                      prompt=lambda k: f"q{k}") -> None:
    """``requests`` chat completions through the official client, ``concurrency`` at a time, each sent as the
    one before it on its connection ends."""
    todo = iter(range(requests))

    async def worker() -> None:
        for k in todo:
            await client.chat.completions.create(model=model, max_tokens=max_tokens,
                                                 messages=[{"role": "user", "content": prompt(k)}])

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def usage_rows(database_url: str) -> list[dict]:
    """Every usage row of a database, read with a fresh engine (the gateway that wrote them may be gone)."""
    engine = make_engine(database_url)
    try:
        return await usage_queries.rows(sessionmaker(engine))
    finally:
        await engine.dispose()


@asynccontextmanager
async def backend_sim_process(*args: str) -> AsyncIterator[tuple[Any, str]]:
    """`fairgate backend-sim` in its own process (so a test can kill it); yields (process, url)."""
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "backend-sim", "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_until_up(url + "/health", proc)
        yield proc, url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def _asyncio_stacks_before_the_timeout(request):
    """A test about to hit pytest-timeout's limit gets every pending asyncio task's stack printed first: the
    timeout's own dump shows only threads, and an async test waits in the loop's select whatever it waits on."""
    import gc
    import sys
    import threading

    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 300)

    def dump() -> None:
        import asyncio

        tasks = [o for o in gc.get_objects() if isinstance(o, asyncio.Task) and not o.done()]
        print(f"\n+++ {request.node.nodeid}: {len(tasks)} pending asyncio tasks near the timeout +++", file=sys.stderr)
        for task in tasks:
            print(f"--- {task.get_name()} {task.get_coro()!r}", file=sys.stderr)
            task.print_stack(limit=12, file=sys.stderr)
        sys.stderr.flush()

    timer = threading.Timer(max(limit - 15, 1), dump)
    timer.daemon = True
    timer.start()
    yield
    timer.cancel()
