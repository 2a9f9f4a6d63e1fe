"""Bad input gets an OpenAI-shaped error with the right status, never a 500 or a traceback."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.conftest import gateway_config, run_gateway


async def _post(gw, key: str | None, body: bytes | dict, path: str = "/v1/chat/completions", **headers):
    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    hdrs.update(headers)
    async with aiohttp.ClientSession() as s:
        kw = {"json": body} if isinstance(body, dict) else {"data": body}
        async with s.post(gw.url + path, headers=hdrs, **kw) as r:
            return r.status, await r.json(), r.headers


def _shape(body) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": "sim-llama"}, "messages"),
    ({"model": "sim-llama", "messages": []}, "messages"),
    ({"model": "sim-llama", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "sim\x1b[2J", "messages": [{"role": "user", "content": "hi"}]}, "model"),  # (shown to operators)
    ({"model": "sim-llama", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"}, "max_tokens"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "temperature": 2.5}, "temperature"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "top_p": -0.1}, "top_p"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3}, "presence_penalty"),
    ({"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "stream_options": {}}, "stream_options"),
])
async def test_malformed_requests_get_400(gw, body, param):
    status, resp, headers = await _post(gw, await gw.key(), body)
    assert status == 400
    err = _shape(resp)
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert headers["x-request-id"]


@pytest.mark.parametrize("message", [
    '{"role": "user", "content": [{"type": "text", "text": %s}]}',
    '{"role": "user", "content": "hi", "name": %s}',
    '{"role": %s, "content": "hi"}',
])
async def test_a_message_field_nested_a_thousand_deep_is_a_400(gw, message):
    deep = "[" * 990 + "]" * 990
    body = ('{"model": "sim-llama", "messages": [%s], "temperature": %s}' % (message % deep, deep)).encode()
    status, resp, _ = await _post(gw, await gw.key(), body, **{"Content-Type": "application/json"})
    assert status == 400 and _shape(resp)


async def test_completions_prompt_type_checked(gw):
    status, resp, _ = await _post(gw, await gw.key(), {"model": "sim-llama", "prompt": {"a": 1}}, "/v1/completions")
    assert status == 400 and _shape(resp)["param"] == "prompt"


async def test_missing_key_401_and_unknown_route_404(gw):
    status, resp, _ = await _post(gw, None, {"model": "sim-llama"})
    assert status == 401 and _shape(resp)["type"] == "authentication_error"
    async with aiohttp.ClientSession() as s, s.get(gw.url + "/v2/nothing") as r:
        assert r.status == 404 and _shape(await r.json())


async def test_unknown_model_404(gw):
    with pytest.raises(openai.NotFoundError) as e:
        await gw.client(await gw.key()).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


async def test_backend_rejection_passes_through_as_400(gw):
    """A prompt longer than the model's context is the client's mistake: the backend's 400, not a 5xx."""
    with pytest.raises(openai.BadRequestError) as e:
        await gw.client(await gw.key()).completions.create(model="sim-llama", prompt="fair " * 5000, max_tokens=8)
    assert "maximum context length" in e.value.message
    [row] = await gw.rows()
    assert row["status"] == "rejected" and row["http_status"] == 400 and row["attempts"] == 1
    # no backend ran it: its prompt is not billed (the row, the limits, the service counted), as the fair queue
    # refunds it
    assert row["prompt_tokens"] == 0 and row["estimated_prompt_tokens"] > 5000 and not gw.gateway.service


async def test_max_tokens_beyond_the_context_is_refused_before_it_queues(gw):
    """max_tokens ≥ the model's context (max_model_len from /v1/models) could never run: 400 at once, so it
    never waits at the head of the queue for an empty backend."""
    with pytest.raises(openai.BadRequestError) as e:
        await gw.client(await gw.key()).completions.create(model="sim-llama", prompt="x", max_tokens=100_000)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"
    [row] = await gw.rows()
    assert row["status"] == "rejected" and row["attempts"] == 0 and row["dispatched_at"] is None


async def test_body_over_limit_413(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url, max_body_bytes=2048)) as gw:
        big = {"model": "sim-llama", "messages": [{"role": "user", "content": "x" * 5000}]}
        status, resp, _ = await _post(gw, await gw.key(), big)
        assert status == 413 and _shape(resp)["code"] == "request_too_large"
        [row] = await gw.rows()
        assert row["status"] == "rejected" and row["http_status"] == 413


async def test_user_key_may_not_claim_another_user_app_key_may(gw):
    user_key = await gw.key(user="alice")
    status, resp, _ = await _post(gw, user_key, {"model": "sim-llama", "user": "bob",
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert status == 403 and _shape(resp)["type"] == "permission_error"
    app_key = await gw.key()
    r = await gw.client(app_key).chat.completions.create(
        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2, user="carol")
    assert r.usage.completion_tokens == 2
    await gw.client(app_key).chat.completions.create(
        model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_headers={"X-Fairgate-User": "dave", "X-Fairgate-Interaction": "run-7"})
    rows = await gw.rows()
    assert [(r["user"], r["status"]) for r in rows] == [("alice", "rejected"), ("carol", "ok"), ("dave", "ok")]
    assert rows[2]["interaction"] == "run-7" and rows[1]["interaction"] == rows[1]["request_id"]


async def test_interaction_stages_counted_or_given(gw):
    client = gw.client(await gw.key())
    msgs = [{"role": "user", "content": "step"}]
    for _ in range(3):
        await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1,
                                             extra_headers={"X-Fairgate-Interaction": "agent-1"})
    await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1,
                                         extra_headers={"X-Fairgate-Interaction": "agent-2", "X-Fairgate-Stage": "4"})
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=1,
                                             extra_headers={"X-Fairgate-Stage": "two"})
    rows = [r for r in await gw.rows() if r["status"] == "ok"]
    assert [(r["interaction"], r["stage"]) for r in rows] == [("agent-1", 0), ("agent-1", 1), ("agent-1", 2),
                                                              ("agent-2", 4)]
