"""A tenant holding one valid key tries to pay less than it used, or to take what others are owed — against a
backend that counts and streams usage as vLLM does (tests/vllm_like_backend.py: each chunk's running usage is
its own choice's, the sums come only in the final chunk)."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.storage.quota_admin import set_quota
from tests.conftest import gateway_config, run_gateway
from tests.vllm_like_backend import IMAGE_TOKENS, MODEL, vllm_like


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
