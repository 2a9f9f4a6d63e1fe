"""/v1/embeddings through the gateway, with the official client: one input and a batch, each one usage row with
the backend's counts (prefill only: no output), refused with a 400 naming the field where the input is wrong,
and held to the app's token limit like chat."""

from __future__ import annotations

import base64
import struct

import aiohttp
import openai
import pytest

from fairgate.quota.quota_admin import set_quota
from tests.conftest import gateway_config, run_gateway


async def test_one_input_and_a_batch_each_leave_one_row_with_the_backend_s_counts(gw):
    client = gw.client(await gw.key("rag", user="u1"))
    one = await client.embeddings.create(model="sim-llama", input="the quick brown fox")  # (base64, decoded)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 64
    assert abs(sum(x * x for x in one.data[0].embedding) - 1.0) < 1e-4
    batch = await client.embeddings.create(model="sim-llama", input=["a b c", "d e", "f g h"],
                                           encoding_format="float", dimensions=8)
    assert [d.index for d in batch.data] == [0, 1, 2] and all(len(d.embedding) == 8 for d in batch.data)
    again = await client.embeddings.create(model="sim-llama", input="the quick brown fox")
    assert again.data[0].embedding == one.data[0].embedding  # (the emulator's vectors are drawn from the ids)

    rows = sorted(await gw.rows(), key=lambda r: r["arrival"])
    assert [r["endpoint"] for r in rows] == ["embeddings"] * 3
    assert [r["prompt_tokens"] for r in rows] == [one.usage.prompt_tokens, batch.usage.prompt_tokens,
                                                  again.usage.prompt_tokens]
    assert batch.usage.prompt_tokens == 3 + 2 + 3
    assert all(r["completion_tokens"] == 0 and r["status"] == "ok" and r["user"] == "u1" for r in rows)


async def test_base64_as_it_came(gw):
    key = await gw.key("rag")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/embeddings", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "sim-llama", "input": "hello", "encoding_format": "base64",
                                "dimensions": 4}) as r:
            assert r.status == 200
            body = await r.json()
    vector = struct.unpack("<4f", base64.b64decode(body["data"][0]["embedding"]))
    assert abs(sum(x * x for x in vector) - 1.0) < 1e-5


@pytest.mark.parametrize("body,param", [
    ({"model": "sim-llama"}, "input"),
    ({"model": "sim-llama", "input": []}, "input"),
    ({"model": "sim-llama", "input": [""]}, "input"),
    ({"model": "sim-llama", "input": {"text": "x"}}, "input"),
    ({"model": "sim-llama", "input": [[1, -2]]}, "input"),
    ({"model": "sim-llama", "input": ["a", [1, 2]]}, "input"),  # strings and token arrays mixed
    ({"model": "sim-llama", "input": ["x"] * 2049}, "input"),
    ({"model": "sim-llama", "input": "x", "stream": True}, "stream"),
    ({"model": "sim-llama", "input": "x", "encoding_format": "bytes"}, "encoding_format"),
    ({"model": "sim-llama", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "sim-llama", "input": "x", "dimensions": "8"}, "dimensions"),
    ({"model": "sim-llama", "input": "x", "n": 2}, "n"),  # a chat field: not forwarded to embeddings
    ({"model": "sim-llama", "input": "x", "priority": -10}, "priority"),  # vLLM's scheduling: not the client's
])
async def test_a_wrong_input_is_a_400_naming_the_field(gw, body, param):
    key = await gw.key("rag")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/embeddings", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
    assert err["param"] == param, err


async def test_embeddings_count_against_the_app_s_token_limit(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("rag")
        await set_quota(gw.admin, "rag", None, None, tpm=200)
        await gw.gateway.tenants.refresh()
        client = gw.client(key)
        served = refused = 0
        for _ in range(20):
            try:
                await client.embeddings.create(model="sim-llama", input=["word " * 20, "word " * 20])
                served += 1
            except openai.RateLimitError:
                refused += 1
        rows = await gw.rows()
    tokens = sum(r["prompt_tokens"] for r in rows if r["status"] == "ok")
    assert served and refused and tokens <= 200, (served, refused, tokens)
    assert {r["throttle_reason"] for r in rows if r["status"] == "throttled"} == {"rate_limit_exceeded"}
