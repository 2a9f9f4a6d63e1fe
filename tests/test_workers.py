"""`fairgate serve --workers N`: N processes share the port (SO_REUSEPORT) as replicas through Redis; every
request still leaves exactly one usage row, SIGTERM drains them all, and without Redis the command refuses."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.conftest import backend_sim_process, free_port, usage_rows, wait_until_up

FG = [sys.executable, "-m", "fairgate.cli.main"]


def _redis() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


async def test_workers_share_the_port_and_each_request_leaves_one_row(sqlite_url):
    redis, redis_url = _redis()
    subprocess.run([*FG, "admin", "app", "create", "w", "--database-url", sqlite_url], check=True,
                   stdout=subprocess.DEVNULL)
    key = json.loads(subprocess.check_output([*FG, "admin", "key", "create", "--app", "w", "--json",
                                              "--database-url", sqlite_url]))["key"]
    port, ops_port = free_port(), free_port()
    config = Path(sqlite_url.removeprefix("sqlite:///")).with_name("ops.yaml")
    config.write_text(f"ops_port: {ops_port}\n")  # /metrics there only, every worker listening
    try:
        async with backend_sim_process("--speed", "50") as (_, backend):
            sup = subprocess.Popen([*FG, "serve", "--config", str(config), "--port", str(port), "--backend", backend,
                                    "--database-url", sqlite_url, "--redis-url", redis_url, "--log-level", "warning",
                                    "--workers", "2"], stderr=subprocess.PIPE)
            url = f"http://127.0.0.1:{port}"
            await wait_until_up(url + "/ready", sup, tries=400)
            body = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "ignore_eos": True}
            # a connection per request: the kernel spreads new connections over the workers; the gateway's
            # request ids (echoed as x-request-id) start with a random prefix per process
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                async def one() -> tuple[str, dict]:
                    async with s.post(url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": f"Bearer {key}"}) as r:
                        assert r.status == 200, await r.text()
                        return r.headers["x-request-id"][4:20], await r.json()

                seen, warm = set(), 0
                while len(seen) < 2 and warm < 400:  # until both workers have answered
                    seen.add((await one())[0])
                    warm += 1
                assert len(seen) == 2
                totals = [await _requests_total(s, f"http://127.0.0.1:{ops_port}")]
                answers = []
                for _ in range(4):
                    answers += await asyncio.gather(*(one() for _ in range(10)))
                    totals += [await _requests_total(s, f"http://127.0.0.1:{ops_port}") for _ in range(3)]
            # every scrape sees both workers (prometheus-client's multiprocess mode): never backwards, all counted
            assert totals == sorted(totals) and totals[-1] == 40 + warm, totals
            assert len({w for w, _ in answers}) == 2  # both served the burst
            answers = [a for _, a in answers]
            assert all(a["usage"]["completion_tokens"] == 5 for a in answers)
            sup.send_signal(signal.SIGTERM)  # each worker drains and writes its rows
            assert sup.wait(timeout=60) == 0
    finally:
        redis.kill()
        redis.wait()
    rows = await usage_rows(sqlite_url)
    assert len(rows) == 40 + warm and len({r["request_id"] for r in rows}) == 40 + warm
    assert all(r["status"] == "ok" and r["completion_tokens"] == 5 for r in rows)
    assert len({r["request_id"][4:20] for r in rows}) == 2


async def _requests_total(s, url: str) -> float:
    """fairgate_requests_total summed over its series, as one scrape of /metrics reports it."""
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("fairgate_requests_total{"))


def test_workers_without_redis_are_refused(sqlite_url):
    out = subprocess.run([*FG, "serve", "--backend", "http://127.0.0.1:9", "--database-url", sqlite_url,
                          "--workers", "2"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--redis-url" in out.stderr + out.stdout
