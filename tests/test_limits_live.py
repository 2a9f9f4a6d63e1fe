"""Limits and budgets through a running gateway and the official OpenAI client (docs/operations/limits.md):
OpenAI's rate-limit headers on every kind of response, 429s a client's retries converge on, budgets that
concurrent streams never overrun, and `usage spend` equal to the sum of the rows."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from fairgate.quota.quota_admin import set_price, set_quota
from fairgate.quota.spend import spend
from fairgate.storage.redis_client import redis_client
from tests.conftest import gateway_config, run_gateway

MSGS = [{"role": "user", "content": "hello there"}]
REDIS = "redis://127.0.0.1:6379/0"


async def _refresh(gw) -> None:
    await gw.gateway.tenants.refresh()


async def test_rate_limit_headers_on_every_response_and_an_honest_429(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("chat", user="ann")
        await set_quota(gw.admin, "chat", None, None, tpm=1_200, rpm=100)
        await _refresh(gw)
        client = gw.client(key)
        raw = await client.chat.completions.with_raw_response.create(model="sim-llama", messages=MSGS, max_tokens=20)
        h = raw.headers
        assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-limit-requests"]) == ("1200", "100")
        first = int(h["x-ratelimit-remaining-tokens"])
        assert first < 1200 and int(h["x-ratelimit-remaining-requests"]) == 99
        assert h["x-ratelimit-reset-tokens"].endswith("s")
        raw = await client.chat.completions.with_raw_response.create(model="sim-llama", messages=MSGS,
                                                                     max_tokens=20, stream=True)
        async for _ in raw.parse():
            pass
        assert int(raw.headers["x-ratelimit-remaining-tokens"]) < first  # a stream's headers too, spent more
        with pytest.raises(openai.NotFoundError) as e:  # an error answer carries them as well
            await client.chat.completions.create(model="no-such-model", messages=MSGS, max_tokens=5)
        assert "x-ratelimit-remaining-tokens" in e.value.response.headers
        # 1,200 a minute; at once, each reserves its prompt and 200 of output (settled to what it used after)
        got = await asyncio.gather(*(client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=200)
                                     for _ in range(10)), return_exceptions=True)
        refused = next((x for x in got if isinstance(x, openai.RateLimitError)), None)
        assert refused is not None and refused.code == "rate_limit_exceeded"
        hdr = refused.response.headers
        assert hdr["x-should-retry"] == "true" and 1 <= int(hdr["retry-after"]) <= 12
        assert hdr["x-ratelimit-remaining-tokens"] == "0" or int(hdr["x-ratelimit-remaining-tokens"]) < 210
        assert "app is limited to 1200 tokens per minute" in str(refused)
        rows = await gw.rows()
        assert rows[-1]["status"] == "throttled" and rows[-1]["throttle_reason"] == "rate_limit_exceeded"
        await asyncio.sleep(1.2)  # the meter drains at 20 tokens a second: remaining recovers
        again = await client.chat.completions.with_raw_response.create(model="sim-llama", messages=MSGS, max_tokens=1)
        # the answered requests settled to what they used, and the meter drained: room again
        assert int(again.headers["x-ratelimit-remaining-tokens"]) > int(hdr["x-ratelimit-remaining-tokens"]) + 20


@pytest.mark.slow
async def test_the_official_client_retrying_converges_on_the_limit(sqlite_url):
    """30 requests at once against 6,000 tokens a minute, each reserving ~210: about 28 fit at once, the rest
    are refused with a retry-after the client waits out; every request succeeds, none surfaces an error."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("chat", user="ann")
        await set_quota(gw.admin, "chat", None, None, tpm=6_000)
        await _refresh(gw)
        client = gw.client(key, max_retries=8)
        done = await asyncio.gather(*(client.chat.completions.create(model="sim-llama", messages=MSGS,
                                                                     max_tokens=200) for _ in range(30)))
        assert len(done) == 30
        rows = await gw.rows()
        assert sum(r["status"] == "ok" for r in rows) == 30
        assert any(r["status"] == "throttled" for r in rows)  # some waited their turn
        assert all(r["status"] in ("ok", "throttled") for r in rows)


async def test_a_budget_is_never_overrun_by_concurrent_streams_and_spend_adds_up(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("chat", user="ann")
        await set_price(gw.admin, "sim-llama", 1.0, 2.0, None)
        await set_quota(gw.admin, "chat", None, None, budget_tokens=1_500, budget_period="month")
        await set_quota(gw.admin, "chat", "ann", None, budget_usd=0.002, budget_period="day")
        await _refresh(gw)
        client = gw.client(key, max_retries=4)  # (the official client's retries, as a user runs it)

        async def one():
            # refused while the requests in flight hold the rest of the budget: 429 rate_limit_exceeded, retried
            # by the client after its retry-after; refused once the spend leaves too little: insufficient_quota
            try:
                stream = await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=100,
                                                              stream=True)
                async for _ in stream:
                    pass
                return "ok"
            except openai.RateLimitError as e:
                if e.code == "rate_limit_exceeded":  # (its retries spent while others held what was left)
                    assert e.response.headers["x-should-retry"] == "true" and "in flight" in str(e), e
                    return "held"
                assert e.code == "insufficient_quota" and e.response.headers["x-should-retry"] == "false", e
                return "quota"

        outcomes = await asyncio.gather(*(one() for _ in range(25)))
        assert outcomes.count("ok") >= 20, outcomes  # (those refused while others held the rest were retried)
        for _ in range(40):  # then one at a time, until the spend leaves too little for one more
            if await one() == "quota":
                break
        else:
            raise AssertionError("the budget was never spent")
        await asyncio.sleep(0.2)  # settlements
        rows = await gw.rows()
        tokens = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
        usd = sum(r["prompt_tokens"] * 1.0 + r["completion_tokens"] * 2.0 for r in rows) / 1e6
        # refused as spent only when the rest cannot cover what one more may use (its prompt, 100 tokens out)
        assert usd + (rows[0]["prompt_tokens"] + 200) / 1e6 > 0.002 or tokens + rows[0]["prompt_tokens"] + 100 > 1_500
        assert tokens <= 1_500 and usd <= 0.002 + 1e-12  # reserved at the most each may produce: never over
        by_app = await spend(gw.gateway.sessions, "app")
        assert by_app == [{"app": "chat", "tokens": tokens, "usd": pytest.approx(usd), "budget_tokens": 1_500,
                           "budget_usd": None, "period": "month"}]
        by_user = await spend(gw.gateway.sessions, "user")
        assert by_user[0]["budget_usd"] == 0.002 and by_user[0]["period"] == "day"


async def test_a_concurrency_cap_and_a_key_limit(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url, emulated={"speed": 1.0})) as gw:
        key = await gw.key("chat", user="ann")
        await set_quota(gw.admin, "chat", None, None, concurrency=2)
        await _refresh(gw)
        client = gw.client(key)

        async def one():
            try:
                await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=40)
                return "ok"
            except openai.RateLimitError as e:
                assert "requests in flight" in str(e)
                return "limited"

        outcomes = await asyncio.gather(*(one() for _ in range(5)))
        assert sorted(outcomes) == ["limited"] * 3 + ["ok"] * 2
        await asyncio.sleep(0.1)
        assert await one() == "ok"  # the slots were given back
        other = await gw.key("chat", user="bob")
        key_id = (await gw.admin.list("keys"))[-1]["id"]
        await set_quota(gw.admin, None, None, str(key_id), rpm=1)
        await _refresh(gw)
        bob = gw.client(other)
        await bob.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=1)
        with pytest.raises(openai.RateLimitError) as e:
            await bob.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=1)
        assert "key is limited to 1 requests per minute" in str(e.value)


async def _spend_a_budget(gw, tokens: int):
    """Ann's key, her client and what it spent: requests of 20 tokens until the app's daily budget of
    ``tokens`` refuses one (``insufficient_quota``)."""
    key = await gw.key("chat", user="ann")
    await set_quota(gw.admin, "chat", None, None, budget_tokens=tokens, budget_period="day")
    await _refresh(gw)
    client = gw.client(key)
    spent = 0
    while True:
        try:
            r = await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=20)
            spent += r.usage.total_tokens
        except openai.RateLimitError as e:
            assert e.code == "insufficient_quota"
            break
    assert 0 < spent <= tokens
    return key, client, spent


async def test_a_restarted_gateway_remembers_a_budget_spent(sqlite_url):
    """The meters of one process are memory; a budget's starts from the usage log's rows of its period."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key, client, spent = await _spend_a_budget(gw, 400)
    async with run_gateway(gateway_config(sqlite_url)) as gw:  # a fresh process on the same database
        client = gw.client(key)
        with pytest.raises(openai.RateLimitError) as e:
            await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=20)
        assert e.value.code == "insufficient_quota"
        assert (await spend(gw.gateway.sessions, "app"))[0]["tokens"] == spent


async def test_a_client_cannot_lower_its_charge(sqlite_url):
    """What a budget's meter holds after a request is what its row counts — whatever the client's max_tokens,
    stream_options or a hang-up mid-stream (the emulator serves n = 1 only; n multiplies what is reserved)."""
    async with run_gateway(gateway_config(sqlite_url, emulated={"speed": 5.0})) as gw:
        key = await gw.key("chat", user="ann")
        await set_quota(gw.admin, "chat", None, None, budget_tokens=10**9, budget_period="total")
        await _refresh(gw)
        client = gw.client(key)
        await gw.hang_up_after(key, {"model": "sim-llama", "messages": MSGS, "max_tokens": 300}, events=6)
        stream = await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=40,
                                                      stream=True, stream_options={"include_usage": False})
        async for _ in stream:
            pass
        await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=5)
        for _ in range(50):
            await asyncio.sleep(0.1)
            rows = await gw.rows()
            if len(rows) == 3 and not gw.gateway.quotas._tasks:
                break
        assert sorted(r["status"] for r in rows) == ["cancelled", "ok", "ok"]
        assert any(r["status"] == "cancelled" and 0 < r["completion_tokens"] < 300 for r in rows)
        meter = "tokens:app:chat:total:total"
        used = gw.gateway.quotas.store.local.used(meter, 0.0, 0.0)
        assert used == sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows)


async def test_a_budget_redis_lost_is_read_from_the_usage_log_again(sqlite_url):
    """Redis restarted without persistence (or flushed, or failed over to a replica behind) forgets the budgets'
    meters; the gateway sees a budget's meter unseeded at its next reservation, gives that back, reads the spend
    from the usage log again and reserves anew: a tenant that spent its budget cannot spend it twice."""
    ns = f"lost{uuid.uuid4().hex[:8]}"
    redis = redis_client(REDIS, 2.0)
    async with run_gateway(gateway_config(sqlite_url, redis_url=REDIS, redis_namespace=ns)) as gw:
        key, client, spent = await _spend_a_budget(gw, 400)
        meters = [k async for k in redis.scan_iter(match=f"{{{ns}}}:q:*", count=10_000)]
        assert any(b":tokens:app:chat:" in k for k in meters), meters
        await redis.delete(*meters)  # what a Redis restarted without persistence would hold of them
        for _ in range(3):
            with pytest.raises(openai.RateLimitError) as e:
                await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=20)
            assert e.value.code == "insufficient_quota"
        assert await gw.gateway.writer.flush()
        assert (await spend(gw.gateway.sessions, "app"))[0]["tokens"] == spent
    await redis.aclose()
