"""vLLM's other endpoints through the gateway: rerank and score (pooling: counted as their pairs' prompts,
fair-queued, one usage row each with the backend's counts), tokenize and detokenize (keyed, sent to a backend
of the model, not queued; a row each too)."""

from __future__ import annotations

import asyncio
import io

import aiohttp
import pytest

from fairgate.logs import ACCESS_LOG
from fairgate.proxy.pipeline.validate import parse


async def _post(gw, key: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + path, headers={"Authorization": f"Bearer {key}"}, json=body) as r:
            return r.status, await r.json()


async def test_rerank_and_score_are_counted_and_leave_their_rows(gw):
    key = await gw.key("rag", user="ann")
    status, ranked = await _post(gw, key, "/v1/rerank", {"model": "sim-llama", "query": "fair queues",
                                                         "documents": ["a b c", "d e", "f g h i"], "top_n": 2})
    assert status == 200 and len(ranked["results"]) == 2
    assert ranked["results"][0]["relevance_score"] >= ranked["results"][1]["relevance_score"]
    status, scored = await _post(gw, key, "/score", {"model": "sim-llama", "text_1": "fair", "text_2": ["x y", "z"]})
    assert status == 200 and [d["index"] for d in scored["data"]] == [0, 1]
    rows = sorted(await gw.rows(), key=lambda r: r["arrival"])
    assert [(r["endpoint"], r["status"]) for r in rows] == [("rerank", "ok"), ("score", "ok")]
    assert [r["prompt_tokens"] for r in rows] == [ranked["usage"]["prompt_tokens"], scored["usage"]["prompt_tokens"]]
    assert all(r["completion_tokens"] == 0 for r in rows)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/rerank", {"model": "sim-llama", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"model": "sim-llama", "query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"model": "sim-llama", "query": "q", "documents": ["a"] * 1025}, "documents"),
    ("/v1/rerank", {"model": "sim-llama", "query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"model": "sim-llama", "query": "q", "documents": ["a"], "stream": True}, "stream"),
    ("/v1/score", {"model": "sim-llama", "text_1": ["a", "b"], "text_2": ["c"]}, "text_1"),
    ("/v1/score", {"model": "sim-llama", "text_1": "a", "text_2": "b", "priority": 1}, "priority"),
    # (a backend may score either form: one checked and counted, the other forwarded unchecked, is refused)
    ("/v1/score", {"model": "sim-llama", "text_1": "a", "text_2": "b", "documents": [{"x": 1}] * 3000}, "queries"),
    ("/tokenize", {"model": "sim-llama"}, "prompt"),
    ("/tokenize", {"model": "sim-llama", "prompt": "x", "chat_template": "{{ x }}"}, "chat_template"),
    ("/detokenize", {"model": "sim-llama", "tokens": [1, -5]}, "tokens"),
])
async def test_a_wrong_request_is_a_400_naming_the_field(gw, path, body, param):
    status, answer = await _post(gw, await gw.key("rag"), path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


async def test_a_request_that_is_not_queued_leaves_its_access_record_as_any(gw, monkeypatch):
    monkeypatch.setattr(ACCESS_LOG, "on", True)
    monkeypatch.setattr(ACCESS_LOG, "stream", io.StringIO())
    status, _ = await _post(gw, await gw.key("rag"), "/tokenize", {"model": "sim-llama", "prompt": "hi"})
    assert status == 200
    await asyncio.sleep(0.05)  # (written after the response, once the loop's turn is over)
    [line] = ACCESS_LOG.stream.getvalue().splitlines()
    assert "endpoint=tokenize" in line and "status=ok" in line and "http_status=200" in line, line


def test_one_text_scored_against_many_is_counted_once_per_pair():
    for first in ('"q"', '["q"]'):
        parsed = parse(b'{"model": "m", "text_1": %s, "text_2": ["a", "b", "c"]}' % first.encode(), "score")
        assert parsed.prompt == ["q", "a", "q", "b", "q", "c"] and parsed.prompts == 3


async def test_tokenize_and_detokenize_go_to_a_backend_of_the_model(gw):
    key = await gw.key("rag")
    status, tokens = await _post(gw, key, "/tokenize", {"model": "sim-llama", "prompt": "hello fair world"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) == 3
    status, text = await _post(gw, key, "/detokenize", {"model": "sim-llama", "tokens": tokens["tokens"]})
    assert status == 200 and text["prompt"] == "hello fair world"
    status, missing = await _post(gw, key, "/tokenize", {"model": "nope", "prompt": "x"})
    assert status == 404
    async with aiohttp.ClientSession() as s:  # a key is needed
        async with s.post(gw.url + "/tokenize", json={"model": "sim-llama", "prompt": "x"}) as r:
            assert r.status == 401
    rows = await gw.rows()
    assert sorted((r["endpoint"], r["http_status"]) for r in rows) == [
        ("detokenize", 200), ("tokenize", 200), ("tokenize", 404)]
    assert {r["backend"] for r in rows if r["http_status"] == 200} <= {"emulated-0", "emulated-1"}


async def test_tokenize_is_held_to_the_request_limits(gw):
    """A loop of tokenizations costs a backend: it counts on the app's requests per minute like any request, and
    the refusal is a 429 with its row."""
    from fairgate.quota.quota_admin import set_quota

    key = await gw.key("rag")
    await set_quota(gw.admin, "rag", None, None, rpm=2)
    await gw.gateway.tenants.refresh()
    statuses = [(await _post(gw, key, path, body))[0] for path, body in (
        ("/tokenize", {"model": "sim-llama", "prompt": "one"}), ("/detokenize", {"model": "sim-llama", "tokens": [1]}),
        ("/tokenize", {"model": "sim-llama", "prompt": "three"}))]
    assert statuses == [200, 200, 429]
    rows = sorted(await gw.rows(), key=lambda r: r["arrival"])
    assert [(r["status"], r["throttle_reason"]) for r in rows][-1] == ("throttled", "rate_limit_exceeded")
