"""The emulated vLLM server speaks vLLM's API as fairgate uses it (shapes: docs/development.md#vllm-api)."""

from __future__ import annotations

import time

import aiohttp
import orjson
import pytest

from fairgate.proxy.control.backends import parse_vllm_metrics
from fairgate.engine.serve import start_emulator


@pytest.fixture
async def emu():
    e = await start_emulator(speed=20, kv_tokens=20_000)
    yield e
    await e.stop()


async def _sse(s, url, body):
    async with s.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    assert text.rstrip().endswith("data: [DONE]")
    return [orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_stream_usage_only_when_asked(emu):
    url = emu.url + "/v1/chat/completions"
    base = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        plain = await _sse(s, url, base)
        assert all("usage" not in c for c in plain)
        assert plain[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert plain[-1]["choices"][0]["finish_reason"] == "length"
        with_usage = await _sse(s, url, {**base, "stream_options": {"include_usage": True}})
        assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 4
        running = await _sse(s, url, {**base, "stream_options": {"include_usage": True,
                                                                 "continuous_usage_stats": True}})
        counts = [c["usage"]["completion_tokens"] for c in running[1:-1]]
        assert counts == [1, 2, 3, 4]


async def test_errors_like_vllm(emu):
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["type"] == "NotFoundError"
        async with s.post(emu.url + "/v1/completions",
                          json={"model": "sim-llama", "prompt": "x", "max_tokens": 5000}) as r:
            assert r.status == 400 and "maximum context length" in (await r.json())["error"]["message"]
        async with s.post(emu.url + "/v1/completions", data=b"{oops") as r:
            assert r.status == 400


async def test_prefix_cache_and_metrics(emu):
    prompt = "a long shared prefix " * 60
    async with aiohttp.ClientSession() as s:
        cached = []
        for _ in range(2):
            async with s.post(emu.url + "/v1/completions",
                              json={"model": "sim-llama", "prompt": prompt, "max_tokens": 2}) as r:
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and cached[1] > 0 and cached[1] % 16 == 0
        async with s.get(emu.url + "/metrics") as r:
            text = await r.text()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:cache_config_info"):
        assert name in text
    m = parse_vllm_metrics(text)
    assert m["vllm:cache_config_info"]["kv_cache_size_tokens"] == "20000"
    assert m["vllm:num_requests_running"] == 0


@pytest.mark.alone  # (it judges a time in real time: run on a quiet machine, tests/suite.py)
async def test_speed_factor_and_exact_lengths(emu):
    body = {"model": "sim-llama", "prompt": "go", "max_tokens": 40, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(emu.url + "/v1/completions", json=body) as r:
            usage = (await r.json())["usage"]
        elapsed = time.perf_counter() - t0
    assert usage["completion_tokens"] == 40
    # 40 tokens at ~33 ms per step on an A10G profile, 20x faster: ~66 ms
    assert 0.05 < elapsed < 0.5
    async with aiohttp.ClientSession() as s:
        async with s.post(emu.url + "/v1/completions", json={**body, "ignore_eos": False}) as r:
            n = (await r.json())["usage"]["completion_tokens"]
    assert 1 <= n <= 40
