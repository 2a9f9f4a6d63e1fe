"""The official openai client against the gateway: chat and completions, streaming and not."""

from __future__ import annotations

import openai
import pytest


async def test_chat_non_streaming_usage_matches_backend(gw):
    client = gw.client(await gw.key(user="alice"))
    r = await client.chat.completions.create(
        model="sim-llama", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    # the emulator frames chat exactly as the gateway counts it, so the count before dispatch is exact
    [row] = await gw.rows()
    assert row["prompt_tokens"] == r.usage.prompt_tokens == row["estimated_prompt_tokens"]
    assert row["system_tokens"] > 0 and row["completion_tokens"] == 12 and row["status"] == "ok"
    assert row["user"] == "alice" and row["app"] == "app1" and row["backend"].startswith("emulated-")


async def test_chat_streaming_with_and_without_usage(gw):
    client = gw.client(await gw.key())
    msgs = [{"role": "user", "content": "count to ten"}]
    stream = await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=7, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])  # running usage the gateway asked for never leaks
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert len(text.split()) == 7

    stream = await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=5, stream=True,
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    rows = await gw.rows()
    assert [r["completion_tokens"] for r in rows] == [7, 5]  # charged even when the client saw no usage


async def test_completions_streaming_and_not(gw):
    client = gw.client(await gw.key())
    r = await client.completions.create(model="sim-llama", prompt="Once upon a time", max_tokens=9,
                                        extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 9 and r.choices[0].text
    stream = await client.completions.create(model="sim-llama", prompt="Once upon a time", max_tokens=4,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    rows = await gw.rows()
    assert [(x["endpoint"], x["stream"]) for x in rows] == [("completions", False), ("completions", True)]


async def test_prefix_cache_hits_are_reported_and_recorded(gw):
    client = gw.client(await gw.key())
    prompt = "shared system prompt " * 40
    usages = []
    for _ in range(3):
        r = await client.completions.create(model="sim-llama", prompt=prompt, max_tokens=2)
        usages.append(r.usage)
    cached = [u.prompt_tokens_details.cached_tokens for u in usages]
    assert cached[0] == 0 and max(cached) > 0  # least-load spreads them, but one backend repeats
    rows = await gw.rows()
    assert [r["cached_tokens"] for r in rows] == cached


async def test_models_list_and_get(gw):
    client = gw.client(await gw.key())
    models = await client.models.list()
    assert [m.id for m in models.data] == ["sim-llama"]
    assert (await client.models.retrieve("sim-llama")).id == "sim-llama"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-nope")
    assert models.data[0].model_extra["max_model_len"] == gw.gateway.pool.context_limit("sim-llama") > 0
    for ask in (lambda c: c.models.list(), lambda c: c.models.retrieve("sim-llama")):
        with pytest.raises(openai.AuthenticationError):  # as OpenAI: no key, no list
            await ask(gw.client("fg-not-a-key"))


async def test_wrong_key_raises_authentication_error(gw):
    with pytest.raises(openai.AuthenticationError) as e:
        await gw.client("fg-not-a-key").chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "invalid_api_key"
    key = await gw.key()
    await gw.admin.set_disabled("app", "app1", True)
    gw.gateway.keys._cache.clear()
    with pytest.raises(openai.AuthenticationError):
        await gw.client(key).chat.completions.create(model="sim-llama", messages=[{"role": "user", "content": "x"}])


async def test_request_id_is_accepted_returned_and_recorded(gw):
    client = gw.client(await gw.key())
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"x-request-id": "trace-abc-123"})
    assert raw.headers["x-request-id"] == "trace-abc-123"
    raw = await client.chat.completions.with_raw_response.create(
        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    generated = raw.headers["x-request-id"]
    assert generated.startswith("req-")
    rows = await gw.rows()
    assert [r["client_request_id"] for r in rows] == ["trace-abc-123", None]
    assert rows[1]["request_id"] == generated and rows[0]["request_id"].startswith("req-")  # never the client's
