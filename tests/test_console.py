"""The console (docs/operations/console.md): the live page on the operations listener, driven in a real browser
(Debian's chromium through Playwright) while two tenants flood two replicas sharing Redis under VTC; its data
stream's access rules; and what it says, from merged snapshots."""

from __future__ import annotations

import asyncio
import os
import uuid
from contextlib import AsyncExitStack

import aiohttp
import openai
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.proxy.control.console import assess, merge
from fairgate.quota.quota_admin import set_quota
from tests.browser import chromium
from tests.conftest import free_port, gateway_config, run_gateway

TOKEN = "ops-" + uuid.uuid4().hex
HOSTILE = "<img src=x onerror=alert(1)>"


def _tenant(service: float, queued: int, weight: float = 1.0, refused: dict | None = None) -> dict:
    return {"service": service, "weight": weight, "queued": queued, "counter": service / weight,
            "oldest_wait_s": 1.5 if queued else 0.0, "refused": refused or {}}


def _snap(at: float, tenants: dict, replica: str = "r1") -> dict:
    return {"replica": replica, "at": at, "policy": "vtc", "tenants": tenants, "slo": {},
            "backends": {"gpu-0": {"up": True, "inflight": 3, "kv_use": 0.5, "kv_committed": 10, "kv_capacity": 100,
                                   "prompt": 100.0, "cached": 40.0}}}


def test_the_fleet_view_sums_replicas_and_says_who_is_served_unfairly():
    before = merge([_snap(100.0, {"a": _tenant(0, 5), "b": _tenant(0, 5)}),
                    _snap(100.0, {"a": _tenant(0, 0)}, replica="r2")])
    now = merge([_snap(105.0, {"a": _tenant(500, 5), "b": _tenant(100, 5, refused={"user_limit": 3})}),
                 _snap(105.0, {"a": _tenant(500, 2)}, replica="r2")])
    assert now["tenants"]["a"]["service"] == 1000 and now["tenants"]["a"]["queued"] == 7
    assert now["backends"]["gpu-0"]["inflight"] == 6 and now["backends"]["gpu-0"]["kv_use"] == 0.5
    view = assess(now, (now, before))
    assert view["tenants"]["a"]["rate"] == 200 and view["tenants"]["b"]["rate"] == 20
    assert view["fairness"]["jain"] < 0.9
    assert view["headline"].startswith("Not fair right now: a gets 10.0× the weighted service of b")
    assert "b was refused 3 times" in view["headline"] and "FairServe" in view["headline"]
    now = merge([_snap(105.0, {"a": _tenant(500, 5), "b": _tenant(1000, 5, weight=2.0)})])
    even = assess(now, (now, merge([_snap(100.0, {"a": _tenant(0, 5), "b": _tenant(0, 5, weight=2.0)})])))
    assert even["headline"].startswith("Fair right now") and even["fairness"]["jain"] == 1.0
    assert assess(merge([_snap(1.0, {})]), None)["headline"].startswith("Nothing is waiting")
    # a replica that joins brings its totals, not a burst: rates come from the replicas that reported both times
    r1_then, r1_now = _snap(100.0, {"a": _tenant(0, 5)}), _snap(105.0, {"a": _tenant(500, 5)})
    joined = _snap(105.0, {"a": _tenant(90_000, 5, refused={"user_limit": 50_000})}, replica="r2")
    view = assess(merge([r1_now, joined]), (merge([r1_now]), merge([r1_then])))
    assert view["tenants"]["a"]["rate"] == 100 and "refused" not in view["headline"]


async def test_the_console_is_the_operations_listener_s_and_needs_its_token(sqlite_url):
    ops = free_port()
    async with run_gateway(gateway_config(sqlite_url, ops_port=ops, ops_token=TOKEN)) as gw, \
            aiohttp.ClientSession() as s:
        for path in ("/console", "/console/events", "/console/console.js"):
            async with s.get(gw.url + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 404, path  # never on the API port
        base = f"http://127.0.0.1:{ops}"
        async with s.get(base + "/console") as r:
            assert r.status == 200 and "default-src 'self'" in r.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
        for path in ("/console/secret.py", "/console/..%2Fconsole.py"):
            async with s.get(base + path) as r:
                assert r.status == 404
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with s.get(base + "/console/events", headers=headers) as r:
                assert r.status == 401
        async with s.get(base + "/console/events", headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 200 and r.headers["content-type"] == "text/event-stream"
            line = await r.content.readline()
            assert line.startswith(b"data: {") and b'"headline"' in line


async def _flood(url: str, key: str, streams: int, stop: asyncio.Event) -> None:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)

    async def one() -> None:
        while not stop.is_set():
            try:
                stream = await client.chat.completions.create(
                    model="sim-llama", messages=[{"role": "user", "content": f"tell me {uuid.uuid4().hex}"}],
                    max_tokens=40, stream=True)
                async for _ in stream:
                    pass
            except openai.APIError:
                await asyncio.sleep(0.2)

    try:
        await asyncio.gather(*(one() for _ in range(streams)))
    finally:
        await client.close()


@pytest.mark.slow
async def test_the_page_shows_two_tenants_converging_and_a_throttled_one_with_its_reason(tmp_path):
    """Two replicas sharing Redis under VTC; alpha floods replica 0 with 16 streams, beta replica 1 with 32. The
    page on replica 0 asks for the token, then shows the whole fleet: both tenants waiting and served alike, a
    tenant named as markup refused by its rate limit (shown as text; no dialog opens), updating without a
    reload and without an error in the browser's console."""
    ns = f"console{uuid.uuid4().hex[:8]}"
    async with AsyncExitStack() as stack:
        from fairgate.engine.serve import start_emulator

        emus = [await start_emulator(speed=10.0, kv_tokens=1000, seed=i) for i in range(2)]
        for e in emus:
            stack.push_async_callback(e.stop)
        backends = [BackendConfig(url=e.url, name=f"gpu-{i}") for i, e in enumerate(emus)]
        ops = [free_port(), free_port()]
        replicas = [await stack.enter_async_context(run_gateway(gateway_config(
            f"sqlite:///{tmp_path}/console.db", policy="vtc", backends=backends, redis_url="redis://127.0.0.1:6379/0",
            redis_namespace=ns, ops_port=ops[i], ops_token=TOKEN, health_interval_s=0.2))) for i in range(2)]
        alpha, beta = [await replicas[0].key("tenants", user=n) for n in ("alpha", "beta")]
        hostile = await replicas[0].key("chat", user=HOSTILE)
        await set_quota(replicas[0].admin, "chat", None, None, rpm=1)
        for r in replicas:
            await r.gateway.tenants.refresh()
        stop = asyncio.Event()
        floods = [asyncio.create_task(_flood(replicas[0].url, alpha, 16, stop)),
                  asyncio.create_task(_flood(replicas[1].url, beta, 32, stop))]
        throttled = replicas[0].client(hostile)
        for _ in range(3):
            try:
                await throttled.chat.completions.create(model="sim-llama", max_tokens=2,
                                                        messages=[{"role": "user", "content": "hi"}])
            except openai.RateLimitError:
                pass
        try:
            async with chromium() as browser:
                page = await browser.new_page(viewport={"width": 1280, "height": 1400})
                errors, dialogs = [], []
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.on("dialog", lambda d: dialogs.append(d.message))
                await page.goto(f"http://127.0.0.1:{ops[0]}/console")
                await page.wait_for_selector("#token", state="visible")  # it asks for the token
                assert not errors, errors  # (loaded without an error)
                await page.fill("#token", "not-the-token")
                await page.click("button[type=submit]")
                await page.wait_for_selector("#login-error", state="visible")
                assert len(errors) == 1 and "401" in errors[0], errors  # (the browser's note of the refusal)
                errors.clear()
                await page.fill("#token", TOKEN)
                await page.click("button[type=submit]")
                await page.wait_for_selector("#fleet", state="visible")

                async def rows() -> dict[str, list[str]]:
                    return await page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
                        '#tenants tbody tr')].map(tr => [tr.cells[0].textContent,
                        [...tr.cells].map(c => c.textContent)]))""")

                alpha_name, beta_name = "user:tenants/alpha", "user:tenants/beta"
                converged = None
                for _ in range(40):  # (a second a point)
                    await asyncio.sleep(1.0)
                    got = await rows()
                    if alpha_name in got and beta_name in got and got[alpha_name][4] != "0" \
                            and got[beta_name][4] != "0":
                        a, b = (float(got[n][3].replace(",", "")) for n in (alpha_name, beta_name))
                        if a > 0 and b > 0 and abs(a - b) <= 0.2 * max(a, b):
                            converged = (a, b, await page.text_content("#headline"))
                            break
                assert converged is not None, (got, await page.text_content("#headline"))
                assert converged[2].startswith("Fair right now"), converged
                status = await page.text_content("#status")
                await asyncio.sleep(2.5)
                assert await page.text_content("#status") != status  # it updates, without a reload
                assert await page.text_content("#replicas") == "2"  # the whole fleet, from one replica's page
                got = await rows()
                refused = f"user:chat/{HOSTILE}"
                assert refused in got and "over its app's requests-per-minute limit" in got[refused][7], got.get(refused)
                assert await page.evaluate("document.querySelectorAll('#tenants img').length") == 0
                assert await page.locator("#share-chart canvas").count() >= 1
                if path := os.environ.get("FAIRGATE_CONSOLE_SCREENSHOT"):  # (the docs' figure)
                    await page.screenshot(path=path, full_page=True)
                assert not dialogs and not errors, (dialogs, errors)
        finally:
            stop.set()
            await asyncio.gather(*floods, return_exceptions=True)


def test_an_installation_without_the_page_files_is_named_before_serving(tmp_path, monkeypatch):
    """`fairgate serve` with ops_port refuses to start, naming the files, when the package lacks them."""
    from fairgate.proxy.control import console

    assert console.missing_assets() == []
    monkeypatch.setattr(console, "STATIC", tmp_path)
    assert console.missing_assets() == list(console.ASSETS)


def test_tenants_past_the_labels_cap_are_summed_in_other_and_still_named_on_the_console():
    """One tenant cycling through names can take every per-tenant label; the tenants waiting past the cap are
    then one ``other`` series holding all their queue (not the last one's), and the console, which is not
    bound by Prometheus's cardinality, still names each."""
    from fairgate.proxy.control.metrics import GatewayMetrics, fairness_gauges

    class Queue:
        def waiting_by_client(self):
            return {"hog/1": 1, "victim/a": 50, "victim/b": 3}

        def counter(self, _client):
            return 0.0

    m = GatewayMetrics(max_tenants=2)
    assert m.tenant("hog/0") == "hog/0"  # (a label taken before: nothing waits for it now)
    fairness_gauges(m, Queue(), {}, lambda _c: 1.0)  # ("hog/1" takes the last label as it waits)
    depth = {s.labels["tenant"]: s.value for f in m.tenant_queue_depth.collect() for s in f.samples}
    assert depth == {"hog/0": 0, "hog/1": 1, "other": 53}
    assert m.name("victim/a") == "victim/a" and m.tenant("victim/a") == "other"
