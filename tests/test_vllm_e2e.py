"""The gateway in front of a genuine vLLM on the CPU passes the same OpenAI-client checks as the emulator."""

from __future__ import annotations

import asyncio
import os
import uuid

import aiohttp
import openai
import pytest

from fairgate.proxy.config import BackendConfig
from fairgate.proxy.control.backends import parse_vllm_metrics
from tests import vllm_server
from tests.conftest import free_port, gateway_config, run_gateway
from tests.vllm_server import MAX_NUM_SEQS, POOLING_NAME, SERVED_NAME

# the deadline of the first test covers a cold install and boot (they share one server, so `make test` keeps
# this module on one xdist worker: --dist loadfile)
pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(vllm_server.READY_TIMEOUT_S + 300)]
MSGS = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def vllm_server_():
    if os.environ.get("FAIRGATE_TEST_VLLM_URL"):  # reuse a server you already run (its KV events, if any, at
        yield vllm_server.VLLMServer(os.environ["FAIRGATE_TEST_VLLM_URL"], None,  # FAIRGATE_TEST_VLLM_KV_EVENTS)
                                     kv_events=os.environ.get("FAIRGATE_TEST_VLLM_KV_EVENTS"))
        return
    launched = os.environ.get(vllm_server.ENV_LAUNCHED)
    if launched:  # the session's server (conftest.py): it may still be installing or booting
        server = vllm_server.VLLMServer.from_env(launched)
        server.wait()
        yield server
        return
    server = vllm_server.VLLMServer.launch(free_port(), *vllm_server.E2E_ARGS, kv_events_port=free_port())
    try:
        server.wait()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def vllm_url(vllm_server_):
    return vllm_server_.url


@pytest.fixture(scope="module")
def pooling_url():
    """The tiny model served as an embedding model: the session's, or one launched for this module."""
    if os.environ.get("FAIRGATE_TEST_VLLM_POOLING_URL"):
        yield os.environ["FAIRGATE_TEST_VLLM_POOLING_URL"]
        return
    launched = os.environ.get(vllm_server.ENV_LAUNCHED_POOLING)
    server = (vllm_server.VLLMServer.from_env(launched) if launched
              else vllm_server.VLLMServer.launch_pooling(free_port()))
    try:
        yield server.wait()
    finally:
        if not launched:
            server.stop()


@pytest.fixture
async def gw(vllm_url, sqlite_url):
    cfg = gateway_config(sqlite_url, policy="vtc", health_interval_s=0.2, backends=[
        BackendConfig(url=vllm_url, name="vllm-cpu", max_num_seqs=MAX_NUM_SEQS)])
    async with run_gateway(cfg) as h:
        yield h


async def _direct(vllm_url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as s, s.post(vllm_url + path, json=body) as r:
        assert r.status == 200
        return await r.json()


async def test_chat_and_completions_with_usage_equal_to_vllms(gw, vllm_url):
    client = gw.client(await gw.key(user="alice"))
    assert [m.id for m in (await client.models.list()).data] == [SERVED_NAME]
    direct = await _direct(vllm_url, "/v1/chat/completions",
                           {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 8, "ignore_eos": True})
    r = await client.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=8,
                                             extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (direct["usage"]["prompt_tokens"], 8)

    stream = await client.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=6, stream=True,
                                                  stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])

    c = await client.completions.create(model=SERVED_NAME, prompt="def f():", max_tokens=5,
                                        extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 5 and c.object == "text_completion"
    stream = await client.completions.create(model=SERVED_NAME, prompt="def f():", max_tokens=4, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = [x async for x in stream]
    assert all(x.usage is None for x in chunks)

    rows = await gw.rows()
    assert [(x["status"], x["completion_tokens"]) for x in rows] == [("ok", 8), ("ok", 6), ("ok", 5), ("ok", 4)]
    # the gateway's pre-dispatch count is an estimate for a model with its own chat template; the row holds vLLM's
    assert rows[0]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert rows[2]["prompt_tokens"] == c.usage.prompt_tokens


async def test_errors_through_vllm(gw):
    client = gw.client(await gw.key())
    with pytest.raises(openai.BadRequestError):  # vLLM's own 400: longer than max_model_len
        await client.chat.completions.create(model=SERVED_NAME, messages=MSGS, max_tokens=600)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="not-served", messages=MSGS)
    with pytest.raises(openai.AuthenticationError):
        await gw.client("fg-wrong").chat.completions.create(model=SERVED_NAME, messages=MSGS)


async def test_prefix_cache_hits_pass_through(gw):
    client = gw.client(await gw.key())
    # a few 128-token blocks, within max_model_len; unique per run, as the server may outlive the test
    prompt = f"# run {uuid.uuid4().hex}\n" + "def fairness(queue, counters):\n    " * 20
    cached = []
    for _ in range(2):
        r = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=2)
        cached.append((r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0))
    assert cached[0] == 0 and cached[1] >= 128
    assert [x["cached_tokens"] for x in await gw.rows()] == cached


async def test_client_disconnect_aborts_the_vllm_request(gw, vllm_url):
    """A client that hangs up mid-stream cancels its request: vLLM stops generating, the row says "cancelled"
    with the tokens generated until then. The client shares the gateway's event loop: when vLLM, short of CPU,
    hands over its output in a burst, the gateway can relay the whole stream before the client reads its third
    event (a row "ok" with all 480 tokens: seen beside the rest of the suite, which is why `make test` runs these
    tests alone, tests/suite.py). That is a hang-up after the end, not the case under test: it is tried again,
    up to three times."""
    key = await gw.key()
    outcomes = []
    for _attempt in range(3):
        await gw.hang_up_after(key, {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 480,
                                     "ignore_eos": True}, events=3)
        async with aiohttp.ClientSession() as s:
            for _ in range(100):
                async with s.get(vllm_url + "/metrics") as m:
                    running = parse_vllm_metrics(await m.text())["vllm:num_requests_running"]
                if running == 0:
                    break
                await asyncio.sleep(0.05)
        assert running == 0
        for _ in range(100):
            rows = await gw.rows()
            if len(rows) > len(outcomes):
                break
            await asyncio.sleep(0.02)
        row = rows[-1]  # (in arrival order)
        outcomes.append({k: row[k] for k in ("status", "completion_tokens", "dispatched_at", "first_token_at",
                                             "finished_at")})
        if not (row["status"] == "ok" and row["completion_tokens"] == 480):  # not a hang-up after the end
            break
    assert len(rows) == len(outcomes)
    assert row["status"] == "cancelled" and 2 <= row["completion_tokens"] < 480, outcomes


async def test_a_cut_stream_of_four_choices_is_billed_all_four(gw):
    """vLLM's running usage on a chunk of an ``n = 4`` stream counts that chunk's choice alone: a client that
    resets the connection half-way is billed what the four choices delivered (at least what it received), not
    one choice's; read whole, the row and the usage chunk are the four choices' sum."""
    from tests.test_hostile_meter import _cut

    key = await gw.key("choices")
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": 100, "n": 4, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    received = await _cut(gw.url, key, "chat/completions", body, 100)  # (chunks with text: a token or more each)
    await _cut(gw.url, key, "chat/completions", body, None)
    await asyncio.sleep(0.5)
    rows = await gw.rows(app="choices")
    assert len(rows) == 2 and rows[1]["completion_tokens"] == 400, rows
    assert 100 <= received <= rows[0]["completion_tokens"] <= 400, (received, rows[0])


async def test_gate_keeps_vllm_queue_empty_while_the_gateway_holds_the_backlog(gw, vllm_url):
    """16 concurrent streams against a vLLM that runs 4 at a time: the backlog waits in the gateway's fair
    queue (in the policy's order), not in vLLM's FCFS queue. vLLM's gauges are sampled: the streams are long
    enough (4 rounds of 192 tokens) for the samples to see it full; at 64 tokens the whole flood once passed in
    six samples, none of them with 4 running."""
    key = await gw.key(user="flood")
    tokens = 192
    body = {"model": SERVED_NAME, "messages": MSGS, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    running, waiting, gateway_queue = [], [], []

    async def one(s):
        async with s.post(gw.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status == 200
            async for _ in r.content:
                pass

    async def watch(s, stop):
        while not stop.is_set():
            async with s.get(vllm_url + "/metrics") as m:
                parsed = parse_vllm_metrics(await m.text())
            running.append(parsed["vllm:num_requests_running"])
            waiting.append(parsed["vllm:num_requests_waiting"])
            gateway_queue.append(len(gw.gateway.dispatcher))
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(s, stop))
        await asyncio.gather(*(one(s) for _ in range(16)))
        stop.set()
        await watcher
    assert max(gateway_queue) >= 8  # the backlog was held by the gateway
    assert max(running) == MAX_NUM_SEQS, running  # vLLM was kept full
    assert max(waiting) <= 1 and sum(waiting) / len(waiting) < 0.2  # and its own queue (near) empty
    rows = await gw.rows()
    assert len(rows) == 16 and all(r["status"] == "ok" and r["completion_tokens"] == tokens for r in rows)
    assert max(r["queue_wait_ms"] for r in rows) > 100


async def test_the_precise_index_follows_vllms_kv_events(vllm_server_, sqlite_url):
    """Precise mode on the genuine vLLM: the gateway subscribes to its KV events (ZMQ), tokenizes prompts with
    the model's own tokenizer and chat template (the backend's /tokenize) and so predicts, for a repeated
    document, exactly the cached tokens vLLM then reports; under another tenant's salt, none."""
    if not vllm_server_.kv_events:
        pytest.skip("the vLLM you run publishes no KV events (set FAIRGATE_TEST_VLLM_KV_EVENTS)")
    cfg = gateway_config(sqlite_url, policy="dlpm", health_interval_s=0.2,
                         locality={"index": "precise", "tokenize": "backend", "block_size": 128},
                         backends=[BackendConfig(url=vllm_server_.url, name="vllm-cpu", max_num_seqs=MAX_NUM_SEQS,
                                                 kv_events=vllm_server_.kv_events)])
    async with run_gateway(cfg) as gw:
        fold = gw.gateway.kv_events.folds["vllm-cpu"]
        doc = f"Document {uuid.uuid4().hex}: " + " ".join(f"w{i % 37}" for i in range(120))  # never cached yet
        msgs = lambda q: [{"role": "system", "content": doc}, {"role": "user", "content": q}]  # noqa: E731
        alice, bob = [gw.client(await gw.key(app, user="u")) for app in ("docs-a", "docs-b")]
        await asyncio.sleep(0.5)  # the SUB socket connects (ZMQ drops what a publisher sends before)
        await alice.chat.completions.create(model=SERVED_NAME, messages=msgs("first?"), max_tokens=2)
        for _ in range(100):
            if gw.gateway.live.index.size("vllm-cpu"):
                break
            await asyncio.sleep(0.1)
        assert gw.gateway.live.index.size("vllm-cpu") >= 1, (fold.last_seq, fold.unchained, gw.gateway.kv_events.malformed)
        await alice.chat.completions.create(model=SERVED_NAME, messages=msgs("second?"), max_tokens=2)
        await bob.chat.completions.create(model=SERVED_NAME, messages=msgs("third?"), max_tokens=2)
        rows = sorted(await gw.rows(), key=lambda r: r["id"])
    second, third = rows[-2], rows[-1]
    assert second["cached_tokens"] >= 128 and second["predicted_cached_tokens"] == second["cached_tokens"], second
    assert third["cached_tokens"] == 0 and third["predicted_cached_tokens"] == 0, third  # another salt


async def test_embeddings_through_a_pooling_vllm_with_its_counts(pooling_url, sqlite_url):
    """One input and a batch through the official client, beside a generative backend: routed to the pooling
    model's server, answered as vLLM answers, one row each with vLLM's prompt tokens and no output."""
    cfg = gateway_config(sqlite_url, policy="vtc", health_interval_s=0.2, backends=[
        BackendConfig(url=pooling_url, name="vllm-embed", max_num_seqs=MAX_NUM_SEQS)])
    async with run_gateway(cfg) as gw:
        client = gw.client(await gw.key("rag", user="ann"))
        direct = await _direct(pooling_url, "/v1/embeddings", {"model": POOLING_NAME, "input": "hello world"})
        one = await client.embeddings.create(model=POOLING_NAME, input="hello world")
        assert one.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
        assert len(one.data[0].embedding) == len(direct["data"][0]["embedding"])
        assert max(abs(a - b) for a, b in zip(one.data[0].embedding, direct["data"][0]["embedding"])) < 1e-5
        batch = await client.embeddings.create(model=POOLING_NAME, input=[[5, 6, 7], [8, 9], [10]],
                                               encoding_format="float")
        assert [d.index for d in batch.data] == [0, 1, 2]
        key = client.api_key
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
            async with s.post(gw.url + "/v1/score", json={"model": POOLING_NAME, "text_1": "fair",
                                                          "text_2": ["queue", "tokens"]}) as r:
                assert r.status == 200, await r.text()
                scored = await r.json()
            async with s.post(gw.url + "/v1/rerank", json={"model": POOLING_NAME, "query": "fair",
                                                           "documents": ["queue", "tokens", "gpu"]}) as r:
                assert r.status == 200, await r.text()
                ranked = await r.json()
        assert len(scored["data"]) == 2 and len(ranked["results"]) == 3
        rows = sorted(await gw.rows(), key=lambda r: r["arrival"])
    assert [(r["endpoint"], r["status"], r["backend"]) for r in rows] == [
        (e, "ok", "vllm-embed") for e in ("embeddings", "embeddings", "score", "rerank")]
    assert [r["prompt_tokens"] for r in rows] == [one.usage.prompt_tokens, batch.usage.prompt_tokens,
                                                  scored["usage"]["prompt_tokens"], ranked["usage"]["prompt_tokens"]]
    assert all(r["completion_tokens"] == 0 for r in rows)


async def test_a_responses_conversation_through_vllm_stored_by_the_gateway(gw):
    """vLLM's /v1/responses behind the gateway's store: a turn whole, one streamed continuing it (vLLM gets the
    whole conversation, store false), each row with vLLM's counts, both one interaction."""
    client = gw.client(await gw.key("agent", user="alice"))
    first = await client.responses.create(model=SERVED_NAME, input="Say something.", max_output_tokens=6,
                                          instructions="You are a test.")
    assert first.id.startswith("resp_") and 0 < first.usage.output_tokens <= 6
    stream = await client.responses.create(model=SERVED_NAME, input="And again.", previous_response_id=first.id,
                                           max_output_tokens=5, stream=True)
    done = None
    async for event in stream:
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert done is not None and done.previous_response_id == first.id
    assert done.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert (await client.responses.retrieve(done.id)).output_text == done.output_text
    rows = sorted(await gw.rows(endpoint="responses"), key=lambda r: r["arrival"])
    assert [(r["status"], r["backend"]) for r in rows] == [("ok", "vllm-cpu")] * 2
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (first.usage.input_tokens, first.usage.output_tokens), (done.usage.input_tokens, done.usage.output_tokens)]
    assert rows[0]["interaction"] == rows[1]["interaction"]


async def test_anthropic_messages_through_vllm(gw):
    """vLLM's /v1/messages with Anthropic's own client: whole and streamed, each row with vLLM's counts."""
    import anthropic

    c = anthropic.AsyncAnthropic(base_url=gw.url, api_key=await gw.key("claude", user="ann"), max_retries=0)
    whole = await c.messages.create(model=SERVED_NAME, max_tokens=6, system="You are a test.",
                                    messages=[{"role": "user", "content": "Say something."}])
    assert whole.type == "message" and 0 < whole.usage.output_tokens <= 6
    async with c.messages.stream(model=SERVED_NAME, max_tokens=5,
                                 messages=[{"role": "user", "content": "Again."}]) as stream:
        final = await stream.get_final_message()
    assert 0 < final.usage.output_tokens <= 5
    rows = sorted(await gw.rows(endpoint="messages"), key=lambda r: r["arrival"])
    assert [(r["status"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        ("ok", whole.usage.input_tokens, whole.usage.output_tokens),
        ("ok", final.usage.input_tokens, final.usage.output_tokens)]
