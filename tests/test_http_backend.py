"""A backend that attacks the gateway (tests/malicious_backend.py), through a real gateway and the official
openai client: what it sends is bounded as it arrives, a status that is no completion is a 502, and
what it reports of usage is clamped to what the request allows."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from fairgate.proxy.config import BackendConfig
from tests.conftest import gateway_config, run_gateway
from tests.malicious_backend import CONTEXT, malicious_backend

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def attacked(sqlite_url):
    async with malicious_backend() as (backend, url), run_gateway(gateway_config(
            sqlite_url, backends=[BackendConfig(url=url, name="evil")], health_interval_s=0.2,
            first_token_timeout_s=60)) as gw:
        key = await gw.key("app1", user="u")
        client = gw.client(key, max_retries=0)
        for _ in range(100):
            if gw.gateway.pool.backends[0].up:
                break
            await asyncio.sleep(0.05)
        yield gw, backend, client


async def _status(client: openai.AsyncOpenAI, model: str) -> tuple[int, float]:
    started = time.monotonic()
    try:
        await client.chat.completions.create(model=model, messages=CHAT, max_tokens=3)
        return 200, time.monotonic() - started
    except openai.APIStatusError as e:
        return e.status_code, time.monotonic() - started


async def test_endless_answers_and_statuses_that_are_no_completion(attacked):
    gw, backend, client = attacked
    # an endless error body: read up to 64 KiB, then the connection is closed (was: read until the timeout)
    status, took = await _status(client, "endless-error")
    assert status == 503 and took < 10
    await asyncio.sleep(0.2)
    assert backend.closed >= 1 and backend.bytes_sent < 64 << 20
    # a header line that never ends: refused at 64 KiB (was: a core pinned and 250 MiB)
    sent = backend.bytes_sent
    status, took = await _status(client, "endless-header")
    assert status == 502 and took < 10
    await asyncio.sleep(0.2)
    assert backend.bytes_sent - sent < 64 << 20
    # 101, 204, 304: never relayed as a final answer with a body (was: the client's connection desynced)
    for model in ("switch", "no-content", "not-modified"):
        assert (await _status(client, model))[0] == 502, model
    # interim 1xx answers are skipped (their fields too: a 103's Content-Length is not the answer's)
    assert (await _status(client, "interim"))[0] == 200
    # an event that is JSON but no object: an upstream failure, never a 500
    assert (await _status(client, "not-object"))[0] in (502, 503)
    # a stream whose trailer section never ends: the events are relayed, the connection dropped at 64 KiB
    answer = await client.chat.completions.create(model="endless-trailer", messages=CHAT, max_tokens=3)
    assert answer.choices[0].message.content == "tok "
    rows = {r["model"]: r for r in await gw.rows()}
    assert rows["endless-header"]["http_status"] == 502 and rows["no-content"]["status"] == "error"


async def test_reported_usage_is_clamped_and_an_endless_stream_is_cut(attacked):
    gw, backend, client = attacked
    await client.chat.completions.create(model="ok", messages=CHAT, max_tokens=3)
    counter = gw.gateway.scheduler.counter("user:app1/u")
    # negative counts: clamped to 0, never lowering the tenant's counter (was: priority for free)
    answer = await client.chat.completions.create(model="negative-usage", messages=CHAT, max_tokens=3)
    assert answer.usage.prompt_tokens == 0 and answer.usage.completion_tokens == 0
    assert gw.gateway.scheduler.counter("user:app1/u") >= counter
    # huge counts: the context for the prompt, n × max_tokens for the output (was: a counter frozen at 5.5e19)
    answer = await client.chat.completions.create(model="huge-usage", messages=CHAT, max_tokens=3, n=2)
    assert answer.usage.prompt_tokens == CONTEXT and answer.usage.completion_tokens == 6
    # a stream past max_tokens: cut with an error event, billed max_tokens (was: relayed, 2,184 tokens billed)
    stream = await client.chat.completions.create(model="endless-stream", messages=CHAT, max_tokens=3, stream=True)
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    with pytest.raises(openai.APIStatusError) as refused:  # the same, not streamed: a 502
        await client.chat.completions.create(model="endless-stream", messages=CHAT, max_tokens=3)
    assert refused.value.status_code == 502
    # text that reads "data:" is not an event: a non-streamed answer of max_tokens such tokens is whole
    answer = await client.chat.completions.create(model="data-text", messages=CHAT, max_tokens=3)
    assert answer.choices[0].message.content == "data: data: data:" * 3
    # a completions batch is generated once per prompt: n × max_tokens each, not in all
    batch = await client.completions.create(model="ok", prompt=["a", "b", "c"], max_tokens=1)
    assert batch.usage.completion_tokens == 3
    rows = [r for r in await gw.rows() if r["model"] == "endless-stream"]
    assert [r["completion_tokens"] <= 3 and r["status"] == "error" for r in rows] == [True, True]
    assert "max_tokens" in rows[0]["error"]
    metrics = gw.gateway.metrics
    assert metrics.usage_clamped.labels("evil")._value.get() >= 4
