"""A tenant holding one valid key tries to pay less than it used, or to take what others are owed — against a
backend that counts and streams usage as vLLM does (tests/vllm_like_backend.py: each chunk's running usage is
its own choice's, the sums come only in the final chunk)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import orjson
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.quota.quota_admin import set_quota
from tests.conftest import gateway_config, run_gateway
from tests.vllm_like_backend import MODEL, vllm_like


def _config(db: str, url: str, **kw):
    return gateway_config(db, backends=[BackendConfig(url=url, name="fake", max_num_seqs=256,
                                                      kv_tokens=10_000_000)], health_interval_s=3600, **kw)


async def _cut(url: str, key: str, endpoint: str, body: dict, tokens: int | None) -> int:
    """Stream ``body``, reading until ``tokens`` output tokens have come (one a chunk), then reset the
    connection (None: read it all). Returns the tokens received."""
    got = 0
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/{endpoint}", json={**body, "stream": True},
                          headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ev = orjson.loads(line[6:])
                    got += sum(bool((c.get("delta") or {}).get("content") or c.get("text"))
                               for c in ev.get("choices", ()))
                if tokens is not None and got >= tokens:
                    if r.connection is not None:  # (None: the whole body has already come)
                        r.connection.transport.abort()  # (a reset, mid-stream)
                    break
    return got


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.98, None])
async def test_a_cut_n16_stream_and_a_cut_16_prompt_batch_are_billed_what_was_delivered(sqlite_url, fraction):
    """``n = 16`` chat and a 16-prompt completions batch, reset at 10 %, 50 %, 98 % of their output or read
    whole: the row (and so every meter) holds within 1 % of the output the client received, and the prompt of
    each prompt, not of one."""
    async with vllm_like() as (backend, url):
        async with run_gateway(_config(sqlite_url, url)) as gw:
            key = await gw.key("hostile")
            chat = {"model": MODEL, "n": 16, "max_tokens": 200, "messages": [{"role": "user", "content": "hi"}]}
            batch = {"model": MODEL, "max_tokens": 100, "prompt": [f"prompt number {k} " * 5 for k in range(16)]}
            received = {}
            for endpoint, body, total in (("chat/completions", chat, 3200), ("completions", batch, 1600)):
                want = None if fraction is None else int(total * fraction)
                received[endpoint] = await _cut(gw.url, key, endpoint, body, want)
            await asyncio.sleep(0.3)
            rows = {r["endpoint"]: r for r in await gw.rows(app="hostile")}
    for endpoint, prompt in (("chat/completions", sum(backend.requests[0]["prompts"])),
                             ("completions", sum(backend.requests[1]["prompts"]))):
        row, got = rows[endpoint.split("/")[0]], received[endpoint]
        # (within 1 %, or the one write of 16 tokens the gateway may have relayed as the client reset)
        assert got <= row["completion_tokens"] <= max(got * 1.01, got + 16), (endpoint, got, row)
        assert row["prompt_tokens"] == prompt, (endpoint, row["prompt_tokens"], prompt)


@pytest.mark.parametrize("upstream", ["json", "stream"])
async def test_a_whole_answer_of_several_choices_is_billed_their_sums(sqlite_url, upstream):
    """Through the official client, not streamed: the answer's usage and the row are the sums over the choices
    and prompts, whether the gateway asks the backend for a whole answer or collects its stream."""
    async with vllm_like() as (backend, url):
        async with run_gateway(_config(sqlite_url, url, nonstream_upstream=upstream)) as gw:
            client = gw.client(await gw.key("hostile"))
            chat = await client.chat.completions.create(model=MODEL, n=4, max_tokens=30,
                                                        messages=[{"role": "user", "content": "hi"}])
            batch = await client.completions.create(model=MODEL, max_tokens=20, prompt=["one two", "three"])
            rows = {r["endpoint"]: r for r in await gw.rows(app="hostile")}
    assert (chat.usage.completion_tokens, chat.usage.prompt_tokens) == (120, backend.requests[0]["prompts"][0])
    assert (batch.usage.completion_tokens, batch.usage.prompt_tokens) == (40, sum(backend.requests[1]["prompts"]))
    assert (rows["chat"]["completion_tokens"], rows["completions"]["completion_tokens"]) == (120, 40)


def _tool(words: int, seed: int = 0) -> dict:
    text = " ".join(f"w{(seed * 7919 + k * 104729) % 100_000}" for k in range(words))
    return {"type": "function", "function": {"name": "lookup", "description": text, "parameters": {
        "type": "object", "properties": {"query": {"type": "string", "description": "what to look up"}},
        "required": ["query"]}}}


PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
PARTS = {  # what a hostile request hides its prompt in: each renders ~2-4k tokens the message text does not hold
    "tools": {"tools": [_tool(900)]},
    "documents": {"extra_body": {"documents": [{"title": "a", "text": " ".join(f"d{k}" for k in range(1500))}]}},
    "images": {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"}] +
                             [{"type": "image_url", "image_url": {"url": PIXEL}}] * 2}]},
    "tool calls": {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments":
                                   orjson.dumps({"q": " ".join(f"a{k}" for k in range(1500))}).decode()}}]},
                                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]},
}


@pytest.mark.parametrize("part", list(PARTS))
async def test_a_budget_holds_against_prompts_hidden_in_tools_documents_images_and_tool_calls(sqlite_url, part):
    """Forty concurrent requests of 50 output tokens whose prompt is mostly in ``tools``, ``documents``, image
    parts or an assistant's tool calls, against a 20,000-token budget, through the official client (which
    retries the 429s that say so): what the rows hold — the backend's counts — never passes the budget, and
    the gateway's count before dispatch was the backend's, or above it."""
    async with vllm_like() as (backend, url):
        async with run_gateway(_config(sqlite_url, url, settings_refresh_s=0.1)) as gw:
            client = gw.client(await gw.key("hostile"), max_retries=3)
            await set_quota(gw.admin, "hostile", None, None, budget_tokens=20_000, budget_period="month")
            await gw.gateway.tenants.refresh()
            body = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}],
                    **PARTS[part]}

            async def one() -> str:
                try:
                    stream = await client.chat.completions.create(**body, stream=True)
                    _ = [c async for c in stream]
                    return "ok"
                except openai.RateLimitError as e:
                    return e.code

            outcomes = await asyncio.gather(*(one() for _ in range(40)))
            await asyncio.sleep(0.3)
            rows = [r for r in await gw.rows(app="hostile") if r["status"] == "ok"]
    spent = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert "ok" in outcomes and "insufficient_quota" in outcomes, outcomes
    assert spent <= 20_000, (spent, len(rows), backend.requests[0]["prompts"])
    assert rows[0]["prompt_tokens"] == backend.requests[0]["prompts"][0] > 1_000


async def test_a_tpm_limit_holds_against_a_prompt_hidden_in_tools(sqlite_url):
    """Forty requests at once, each with a ~1,000-token tool and 50 output tokens, against 3,000 tokens a
    minute: what is admitted at once fits the minute (the rest are told when to retry)."""
    async with vllm_like() as (backend, url):
        async with run_gateway(_config(sqlite_url, url)) as gw:
            client = gw.client(await gw.key("hostile"))
            await set_quota(gw.admin, "hostile", None, None, tpm=3_000)
            await gw.gateway.tenants.refresh()

            async def one() -> str:
                try:
                    await client.chat.completions.create(model=MODEL, max_tokens=50, tools=[_tool(400)],
                                                         messages=[{"role": "user", "content": "hi"}])
                    return "ok"
                except openai.RateLimitError as e:
                    return e.code

            outcomes = await asyncio.gather(*(one() for _ in range(40)))
            rows = [r for r in await gw.rows(app="hostile") if r["status"] == "ok"]
    used = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert outcomes.count("rate_limit_exceeded") >= 30 and rows[0]["prompt_tokens"] > 500, outcomes
    assert used <= 3_000, (used, len(rows))


async def test_a_predictor_taught_short_answers_buys_at_most_half_a_limit_more(sqlite_url):
    """An app teaches the output predictor that its prompts get 2-token answers (25 of them), then sends 60
    long ones at once (500 tokens each, the same prompt length) against 3,000 tokens a minute: admitted at the
    short prediction, all 60 were served (30,000 tokens). Now the requests in flight may leave at most half the
    limit unreserved: the tokens served stay within 1.5× the limit, plus what the meter drained (50 tokens a
    second) while the test ran, the rest told when to retry."""
    async with vllm_like(step_s=0.001) as (backend, url):
        async with run_gateway(_config(sqlite_url, url)) as gw:
            client = gw.client(await gw.key("hostile"), max_retries=0)
            await set_quota(gw.admin, "hostile", None, None, tpm=3_000)
            await gw.gateway.tenants.refresh()

            async def one(k: int, eos: int) -> str:
                try:
                    stream = await client.chat.completions.create(
                        model=MODEL, max_tokens=500, stream=True,
                        messages=[{"role": "user", "content": f"question {k:03d}, eos:{eos:03d}"}])
                    async for _ in stream:
                        pass
                    return "ok"
                except openai.RateLimitError as e:
                    return e.code

            start = time.monotonic()
            taught = [await one(k, 2) for k in range(25)]
            outcomes = await asyncio.gather(*(one(k, 500) for k in range(60)))
            drained = 3_000 / 60 * (time.monotonic() - start)  # (a busy machine stretches the run)
            await asyncio.sleep(0.3)
            rows = [r for r in await gw.rows(app="hostile") if r["status"] == "ok"]
    served = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert taught == ["ok"] * 25 and outcomes.count("rate_limit_exceeded") >= 45, outcomes
    assert served <= 1.5 * 3_000 + drained, (served, len(rows), drained)


async def test_a_non_streaming_client_without_max_tokens_that_leaves_is_billed_what_was_generated(sqlite_url):
    """A non-streamed request without ``max_tokens`` (up to the model's context), abandoned after half a
    second: billed what the backend had generated by then, not a guess."""
    async with vllm_like() as (backend, url):
        async with run_gateway(_config(sqlite_url, url)) as gw:
            key = await gw.key("hostile")
            async with aiohttp.ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    async with asyncio.timeout(0.5):
                        await s.post(f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            await asyncio.sleep(0.3)
            rows = await gw.rows(app="hostile")
    sent = backend.requests[0]["sent"]
    assert rows[0]["status"] == "cancelled" and 50 < sent < 1000, (rows[0], sent)
    assert sent - 2 <= rows[0]["completion_tokens"] <= sent, (rows[0]["completion_tokens"], sent)


async def test_an_app_naming_many_users_cannot_fill_the_queue_for_the_others(sqlite_url):
    """An app that floods as many users is held to ``max_queued_per_app`` waiting requests, all its users
    together (429 app_queue_full); another app's request still waits its turn and is served."""
    from tests.test_trust_boundary import CHAT, _post

    cfg = gateway_config(sqlite_url, policy="vtc", max_queued=100, max_queued_per_tenant=2, max_queued_per_app=3,
                         emulated={"count": 1, "max_num_seqs": 1, "speed": 5.0})
    async with run_gateway(cfg) as gw:
        keys = [await gw.key("flood", user=f"u{k}") for k in range(6)]
        other = await gw.key("other", user="ann")
        body = {**CHAT, "max_tokens": 40}
        flood = [asyncio.create_task(_post(gw, k, body)) for k in keys]  # 1 runs, 3 wait, 2 are refused
        await asyncio.sleep(0.3)
        results = await asyncio.gather(*flood, _post(gw, other, body))
        codes = sorted((status, (resp.get("error") or {}).get("code")) for status, resp, _ in results)
        assert codes == [(200, None)] * 5 + [(429, "app_queue_full")] * 2, codes
        assert results[-1][0] == 200 and gw.gateway.dispatcher._queued_apps == {}


async def test_an_app_s_users_beyond_max_users_per_app_wait_as_the_app(sqlite_url):
    """Under ``fairness_key: user`` an app's first ``max_users_per_app`` waiting users wait as themselves; a
    further user waits as the app (``app:<app>``, its calls that name no user), sharing the app's turns —
    until one of the first leaves the queue. Another app's users are not counted against it."""
    from tests.test_trust_boundary import CHAT, _post

    cfg = gateway_config(sqlite_url, policy="vtc", max_users_per_app=2,
                         emulated={"count": 1, "max_num_seqs": 1, "speed": 5.0})
    async with run_gateway(cfg) as gw:
        keys = [await gw.key("many", user=f"u{k}") for k in range(4)] + [await gw.key("other", user="ann")]
        body = {**CHAT, "max_tokens": 20}
        first = asyncio.create_task(_post(gw, keys[0], {**CHAT, "max_tokens": 400}))  # runs: waits no more
        await asyncio.sleep(0.1)
        waiting = []
        for k in (1, 2, 3, 4):  # u1 and u2 wait as themselves, u3 as the app; ann as herself
            waiting.append(asyncio.create_task(_post(gw, keys[k], body)))
            await asyncio.sleep(0.05)
        await asyncio.gather(first, *waiting)
        rows = {r["user"]: r["fairness_key"] for r in await gw.rows()}
    assert rows == {"u0": "user:many/u0", "u1": "user:many/u1", "u2": "user:many/u2", "u3": "app:many",
                    "ann": "user:other/ann"}, rows
    assert gw.gateway.dispatcher._users_waiting == {}


async def test_a_shared_user_waiting_through_two_apps_is_counted_once_and_released(sqlite_url):
    """A user an admin shared among apps waits through app A, then through app B while still waiting: it
    counts once, for the app it came through first, and leaves nothing counted when it is served."""
    from tests.test_trust_boundary import CHAT, _post

    cfg = gateway_config(sqlite_url, policy="vtc", max_users_per_app=1,
                         emulated={"count": 1, "max_num_seqs": 1, "speed": 5.0})
    async with run_gateway(cfg) as gw:
        for app in ("A", "B"):
            await gw.admin.create_app(app)
        await gw.admin.create_user("ops")  # shared: every app's keys may name it
        await gw.gateway.tenants.refresh()
        a, b = (await gw.admin.create_key("A", "ops"))["key"], (await gw.admin.create_key("B", "ops"))["key"]
        first = asyncio.create_task(_post(gw, a, {**CHAT, "max_tokens": 400}))  # runs
        await asyncio.sleep(0.1)
        waiting = [asyncio.create_task(_post(gw, k, {**CHAT, "max_tokens": 20})) for k in (a, b)]
        await asyncio.sleep(0.1)
        assert gw.gateway.dispatcher._users_waiting == {"A": 1}
        results = await asyncio.gather(first, *waiting)
        assert [status for status, _, _ in results] == [200, 200, 200]
        assert gw.gateway.dispatcher._users_waiting == {} and gw.gateway.dispatcher._user_app == {}
        assert {r["fairness_key"] for r in await gw.rows()} == {"user:ops"}


@pytest.mark.slow
@pytest.mark.alone  # (it judges waits in real time: run on a quiet machine, tests/suite.py)
@pytest.mark.parametrize("fairness_key", ["user", "app>user"])
async def test_an_app_flooding_as_200_users_does_not_delay_or_shed_another_app(sqlite_url, fairness_key):
    """One app floods as 200 user names (200 streams, one each, on backends at a fifth of an A10G's pace);
    another app's requests of a sheddable class (TTFT target 4 s) are all served, none shed, with a median wait
    in the queue under 2 s. Under ``app>user`` the flood is one app taking turns, for the queue and for shedding
    alike; under ``user`` it is at most ``max_users_per_app`` (16) users and the app itself."""
    from fairgate.accounting.slo import SloClass
    from tests.test_fair_dispatch import BODY, _stream

    cfg = gateway_config(sqlite_url, fairness_key=fairness_key, emulated={"speed": 2.0, "kv_tokens": 1000},
                         settings_refresh_s=0.1)
    async with run_gateway(cfg) as gw:
        flood_key, other = await gw.key("flood"), gw.client(await gw.key("other"))
        await gw.admin.set_slo("other", SloClass("quick", ttft_ms=4_000, sheddable=True))
        await gw.gateway.tenants.refresh()
        stop = asyncio.Event()

        async def flooder(session: aiohttp.ClientSession, k: int) -> None:
            while not stop.is_set():
                await _stream(session, gw.url, flood_key, {**BODY, "max_tokens": 100, "user": f"u{k}"})

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = [asyncio.create_task(flooder(s, k)) for k in range(200)]
            await asyncio.sleep(2.0)
            assert len(gw.gateway.dispatcher) > 100  # the flood keeps a backlog
            shed = 0
            for _ in range(8):
                try:
                    await other.chat.completions.create(model="sim-llama", max_tokens=10,
                                                        messages=[{"role": "user", "content": "quick one"}])
                except openai.RateLimitError:
                    shed += 1
                await asyncio.sleep(0.2)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        rows = await gw.rows(app="other")
    waits = sorted(r["queue_wait_ms"] for r in rows if r["status"] == "ok")
    # (shed 8 of 8 when shedding counted each of the 200 users as a tenant ahead, and under user when each of
    # them was a tenant; with 32 users a share, 0-2 shed and a median of 3.5 s; with 16, 0 and 1.57 s)
    assert shed == 0 and len(waits) == 8, (shed, rows)
    assert waits[len(waits) // 2] < 2_000, waits


async def test_a_budget_holds_against_tools_through_two_replicas_sharing_redis(tmp_path):
    """The same flood of tool-heavy requests through two replicas sharing one Redis: the fleet's spend stays
    within the budget, and a refusal tells a budget held by requests in flight (retried by the client) from
    one spent."""
    import uuid

    db, ns = f"sqlite+aiosqlite:///{tmp_path}/fleet.db", f"t{uuid.uuid4().hex[:8]}"
    async with vllm_like() as (backend, url):
        cfg = lambda: _config(db, url, redis_url="redis://127.0.0.1:6379/0", redis_namespace=ns)  # noqa: E731
        async with run_gateway(cfg()) as a, run_gateway(cfg()) as b:
            key = await a.key("hostile")
            await set_quota(a.admin, "hostile", None, None, budget_tokens=20_000, budget_period="month")
            for gw in (a, b):
                await gw.gateway.tenants.refresh()
            clients = [gw.client(key, max_retries=3) for gw in (a, b)]
            body = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}],
                    "tools": [_tool(900)]}

            async def one(k: int) -> str:
                try:
                    stream = await clients[k % 2].chat.completions.create(**body, stream=True)
                    _ = [c async for c in stream]
                    return "ok"
                except openai.RateLimitError as e:
                    return e.code

            outcomes = await asyncio.gather(*(one(k) for k in range(40)))
            await asyncio.sleep(0.3)
            assert await b.gateway.writer.flush()
            rows = [r for r in await a.rows(app="hostile") if r["status"] == "ok"]  # (one database)
    spent = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
    assert "ok" in outcomes and "insufficient_quota" in outcomes, outcomes
    assert spent <= 20_000, (spent, len(rows))
