"""Anthropic's Messages API through the gateway, with Anthropic's official client (``x-api-key``): whole and
streamed, counted as it streams and by the usage the backend reports, one usage row each, errors in Anthropic's
shape, and the prompt counted by ``/v1/messages/count_tokens``."""

from __future__ import annotations

import aiohttp
import anthropic
import pytest

MODEL = "sim-llama"


def client(gw, key: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


async def test_a_message_whole_and_streamed_each_leave_a_row_with_the_backend_s_counts(gw):
    c = client(gw, await gw.key("claude-app", user="ann"))
    whole = await c.messages.create(model=MODEL, max_tokens=6, system="Be brief.",
                                    messages=[{"role": "user", "content": "Hello there"}])
    assert whole.type == "message" and whole.content[0].type == "text" and 0 < whole.usage.output_tokens <= 6
    texts, final = [], None
    async with c.messages.stream(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Count to three."}]}]) as stream:
        async for text in stream.text_stream:
            texts.append(text)
        final = await stream.get_final_message()
    assert "".join(texts) == final.content[0].text and 0 < final.usage.output_tokens <= 5
    counted = await c.messages.count_tokens(model=MODEL, system="Be brief.",
                                            messages=[{"role": "user", "content": "Hello there"}])
    assert counted.input_tokens > 0
    rows = sorted(await gw.rows(), key=lambda r: r["arrival"])
    assert [(r["endpoint"], r["status"]) for r in rows] == [("messages", "ok"), ("messages", "ok"),
                                                           ("messages.count_tokens", "ok")]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows[:2]] == [
        (whole.usage.input_tokens, whole.usage.output_tokens), (final.usage.input_tokens, final.usage.output_tokens)]
    assert rows[0]["user"] == "ann"


@pytest.mark.parametrize("kwargs,status", [
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400),
    ({"messages": [{"role": "system", "content": "x"}], "max_tokens": 5}, 400),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "http://169.254.169.254/"}}]}], "max_tokens": 5}, 400),  # (the server would fetch)
])
async def test_errors_in_anthropic_s_shape(gw, kwargs, status):
    c = client(gw, await gw.key("claude-app"))
    with pytest.raises(anthropic.APIStatusError) as e:
        await c.messages.create(model=MODEL, **kwargs)
    assert e.value.status_code == status and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"


async def test_a_wrong_key_is_anthropic_s_authentication_error(gw):
    with pytest.raises(anthropic.AuthenticationError) as e:
        await client(gw, "fg-wrong").messages.create(model=MODEL, max_tokens=5,
                                                      messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"


async def test_a_count_of_a_body_nested_past_what_json_is_written_with_is_a_400(gw):
    key = await gw.key("claude-app")
    body = ('{"model": "%s", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [%s]}'
            % (MODEL, "[" * 300 + "]" * 300))
    async with aiohttp.ClientSession(headers={"x-api-key": key, "anthropic-version": "2023-06-01",
                                              "Content-Type": "application/json"}) as s:
        async with s.post(f"{gw.url}/v1/messages/count_tokens", data=body) as r:
            assert r.status == 400, await r.text()
            assert (await r.json())["type"] == "error"  # (Anthropic's shape)
