"""The Responses API through the gateway, with the official client: created (whole and streamed), stored by the
gateway and continued with ``previous_response_id`` (the backend gets the whole conversation, any backend may
serve a turn), read, listed, counted and deleted; scoped to the app and user that made it; one usage row per
request, the turns of a conversation sharing one interaction."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

from fairgate.proxy.call import utcnow
from fairgate.proxy.pipeline.responses import ITEM_TYPES
from tests.conftest import gateway_config, run_gateway

MODEL = "sim-llama"


async def test_a_three_turn_conversation_stored_by_the_gateway(gw):
    client = gw.client(await gw.key("agent", user="ann"))
    first = await client.responses.create(model=MODEL, input="Plan a trip.", max_output_tokens=8,
                                          instructions="Be brief.", metadata={"case": "trip"})
    assert first.id.startswith("resp_") and len(first.id) == 53 and first.status in ("incomplete", "completed")
    assert first.output_text and 0 < first.usage.output_tokens <= 8 and first.metadata == {"case": "trip"}
    second = await client.responses.create(model=MODEL, input="And the hotel?", previous_response_id=first.id,
                                           max_output_tokens=6)
    assert second.previous_response_id == first.id
    # the backend got the whole conversation: the first turn's input and output, then this one
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    stream = await client.responses.create(model=MODEL, input=[{"role": "user", "content": "Thanks."}],
                                           previous_response_id=second.id, max_output_tokens=5, stream=True)
    kinds, done = [], None
    async for event in stream:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            done = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    assert done.previous_response_id == second.id and 0 < done.usage.output_tokens <= 5
    third = done

    got = await client.responses.retrieve(third.id)
    assert got.id == third.id and got.output_text == third.output_text
    items = await client.responses.input_items.list(third.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Thanks."
    counted = await client.responses.input_tokens.count(model=MODEL, input="one more?",
                                                        previous_response_id=third.id)
    assert counted.input_tokens > third.usage.input_tokens

    rows = sorted(await gw.rows(endpoint="responses"), key=lambda r: r["arrival"])
    assert [r["status"] for r in rows] == ["ok"] * 3
    assert len({r["interaction"] for r in rows}) == 1  # one conversation, one interaction
    assert [r["completion_tokens"] for r in rows] == [first.usage.output_tokens, second.usage.output_tokens,
                                                      third.usage.output_tokens]
    assert [r["prompt_tokens"] for r in rows] == [first.usage.input_tokens, second.usage.input_tokens,
                                                  third.usage.input_tokens]

    deleted = await client.responses.delete(third.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):  # a deleted turn cannot be continued
        await client.responses.create(model=MODEL, input="more", previous_response_id=third.id)


async def test_an_id_the_gateway_could_not_have_made_is_not_looked_up(gw):
    key = await gw.key("agent")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        for rid in ("resp_%00", "resp_" + "g" * 48, "x" * 70):
            async with s.get(f"{gw.url}/v1/responses/{rid}") as r:
                assert r.status == 404
        async with s.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "x",
                                                          "previous_response_id": "resp_\u0000"}) as r:
            assert r.status == 404


async def test_reads_and_deletions_leave_their_rows_and_need_a_key_first(gw):
    key = await gw.key("agent", user="ann")
    client = gw.client(key)
    first = await client.responses.create(model=MODEL, input="keep this", max_output_tokens=4)
    await client.responses.retrieve(first.id)
    await client.responses.input_items.list(first.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_" + "0" * 48)
    await client.responses.delete(first.id)
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{gw.url}/v1/responses/not-an-id") as r:  # (no key: 401, whatever the id)
            assert r.status == 401
    reads = await gw.rows(endpoint="responses.get")
    assert sorted((r["status"], r["http_status"]) for r in reads) == [("ok", 200), ("ok", 200), ("rejected", 404)]
    assert all(r["user"] == "ann" and r["app"] == "agent" for r in reads)
    assert [(r["status"], r["http_status"]) for r in await gw.rows(endpoint="responses.delete")] == [("ok", 200)]


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("path, field, status", [
    ("/v1/responses", "metadata", 400), ("/v1/responses", "temperature", 400), ("/v1/responses", "user", 400),
    ("/v1/responses", "previous_response_id", 400), ("/v1/responses", "model", 400),
    ("/v1/responses/input_tokens", "model", 404), ("/v1/responses/input_tokens", "previous_response_id", 404),
    ("/v1/embeddings", "dimensions", 400), ("/tokenize", "model", 404),
])
async def test_a_value_nested_a_thousand_deep_is_refused_not_a_500(gw, path, field, status):
    key = await gw.key("agent")
    fields = {"model": f'"{MODEL}"', "input": '"hi"', field: deep(990)}
    if path == "/tokenize":
        fields = {"model": deep(990), "prompt": '"hi"'}
    body = "{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.post(gw.url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status, await r.text()
            assert len(await r.read()) < 1000  # (the value is named, never shown)


async def test_another_tenant_s_response_is_not_found(gw):
    mine = gw.client(await gw.key("agent", user="ann"))
    first = await mine.responses.create(model=MODEL, input="secret plans", max_output_tokens=4)
    for other in (gw.client(await gw.key("other-app")), gw.client(await gw.key("agent", user="bob"))):
        with pytest.raises(openai.NotFoundError):
            await other.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.create(model=MODEL, input="go on", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await other.responses.input_items.list(first.id)
    with pytest.raises(openai.NotFoundError):
        await mine.responses.retrieve("resp_" + "0" * 48)
    assert (await mine.responses.retrieve(first.id)).id == first.id  # (still there for its owner)


async def test_store_false_keeps_nothing_and_a_function_call_round_trip(gw):
    client = gw.client(await gw.key("agent"))
    unstored = await client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(unstored.id)
    tools = [{"type": "function", "name": "lookup", "description": "Look a word up.",
              "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}]
    call = await client.responses.create(model=MODEL, input="define fair", tools=tools, tool_choice="required",
                                         max_output_tokens=4)
    fc = call.output[0]
    assert fc.type == "function_call" and fc.name == "lookup" and fc.arguments.startswith('{"text":')
    answer = await client.responses.create(model=MODEL, previous_response_id=call.id, max_output_tokens=4,
                                           input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                   "output": "just and impartial"}])
    assert answer.output[0].type == "message"


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "input"),
    ({"model": MODEL, "input": []}, "input"),
    ({"model": MODEL, "input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"model": MODEL, "input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"model": MODEL, "input": "x", "background": True}, "background"),
    ({"model": MODEL, "input": "x", "conversation": "conv_1"}, "conversation"),
    ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": MODEL, "input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"model": MODEL, "input": "x", "store": "yes"}, "store"),
    ({"model": MODEL, "input": "x", "max_tokens": 5}, "max_tokens"),  # chat's field: not a response's
    ({"model": MODEL, "input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output"),
    ({"model": MODEL, "input": [{"type": "reasoning", "summary": True}]}, "input[0].summary"),
    ({"model": MODEL, "input": [{"role": "user", "content": [  # (the server would fetch it)
        {"type": "input_image", "image_url": "http://169.254.169.254/latest"}]}]}, "input"),
    ({"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"x": nested(300)}}]},
     None),  # (nesting past what JSON is written with)
])
async def test_a_wrong_request_is_a_400_naming_the_field(gw, body, param):
    key = await gw.key("agent")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{gw.url}/v1/responses", headers={"Authorization": f"Bearer {key}"}, json=body) as r:
            assert r.status == 400, await r.text()
            assert (await r.json())["error"]["param"] == param


async def test_a_conversation_past_its_turns_is_refused(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url, response_max_turns=2)) as gw:
        client = gw.client(await gw.key("agent"))
        one = await client.responses.create(model=MODEL, input="a", max_output_tokens=2)
        two = await client.responses.create(model=MODEL, input="b", previous_response_id=one.id,
                                            max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as e:
            await client.responses.create(model=MODEL, input="c", previous_response_id=two.id, max_output_tokens=2)
        assert e.value.code == "conversation_too_long"


def test_the_item_types_are_the_ones_a_backend_renders():
    assert set(ITEM_TYPES) == {"message", "function_call", "function_call_output", "reasoning"}


async def test_a_conversation_continues_through_another_replica_on_another_backend(pg_url):
    """Two replicas sharing one database, each in front of a backend of its own: the turns alternate between
    them, each continues what the other stored, and the backends see the whole conversation."""
    from fairgate.engine.serve import start_emulator
    from fairgate.proxy.config import BackendConfig

    emulators = [await start_emulator(speed=50.0, seed=k) for k in range(2)]
    try:
        configs = [gateway_config(pg_url, backends=[BackendConfig(url=e.url, name=f"gpu-{k}")])
                   for k, e in enumerate(emulators)]
        async with run_gateway(configs[0]) as a, run_gateway(configs[1]) as b:
            key = await a.key("agent", user="ann")
            clients = [a.client(key), b.client(key)]
            previous, inputs = None, []
            for turn in range(3):
                r = await clients[turn % 2].responses.create(model=MODEL, input=f"turn {turn}", max_output_tokens=4,
                                                             previous_response_id=previous)
                inputs.append(r.usage.input_tokens)
                previous = r.id
            assert inputs[0] < inputs[1] < inputs[2]  # each turn sent the conversation so far
            assert await b.gateway.writer.flush()
            rows = sorted(await a.rows(endpoint="responses"), key=lambda r: r["arrival"])
    finally:
        for e in emulators:
            await e.stop()
    assert [r["backend"] for r in rows] == ["gpu-0", "gpu-1", "gpu-0"]
    assert len({r["interaction"] for r in rows}) == 1


async def test_a_store_that_fails_is_said_not_fatal(sqlite_url):
    """The database loses the store's table: a new response is still answered, saying store: false; a
    follow-up or a read is a 503 the client may retry, never a 500."""
    import sqlite3

    async with run_gateway(gateway_config(sqlite_url)) as gw:
        client = gw.client(await gw.key("agent"))
        first = await client.responses.create(model=MODEL, input="hello", max_output_tokens=3)
        with sqlite3.connect(sqlite_url.split("///", 1)[1]) as db:
            db.execute("DROP TABLE stored_responses")
        answered = await client.responses.create(model=MODEL, input="still there?", max_output_tokens=3)
        assert answered.store is False and answered.output_text
        for attempt in (client.responses.retrieve(first.id),
                        client.responses.create(model=MODEL, input="go on", previous_response_id=first.id)):
            with pytest.raises(openai.InternalServerError) as e:
                await attempt
            assert e.value.status_code == 503 and e.value.code == "store_unavailable"


async def test_a_response_past_retention_is_not_found_and_is_purged(sqlite_url):
    # (a retention long enough for the first read on a machine busy with the rest of the suite: 0.5 s was not)
    async with run_gateway(gateway_config(sqlite_url, response_retention_s=2.0)) as gw:
        client = gw.client(await gw.key("agent"))
        first = await client.responses.create(model=MODEL, input="soon gone", max_output_tokens=2)
        assert (await client.responses.retrieve(first.id)).id == first.id

        await asyncio.sleep(2.1)  # (past its retention)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model=MODEL, input="go on", previous_response_id=first.id)
        assert await gw.gateway.responses.purge(utcnow()) == 1  # (forgotten at the next purge)
        assert gw.gateway.responses.app_bytes == {"agent": 0}  # (and its bytes with it)


async def test_an_app_s_stored_bytes_are_capped_across_replicas(pg_url):
    """Past ``response_max_app_bytes``, a request that would store one more response is a 429 on every replica
    (the other learns the total at its next refresh); one that stores nothing is served, another app is not
    held, and deleting brings the app back under its cap. The totals are what the rows hold."""
    from sqlalchemy import text

    cap = 6_000
    config = dict(response_max_app_bytes=cap, settings_refresh_s=0.1)
    async with run_gateway(gateway_config(pg_url, **config)) as a, run_gateway(gateway_config(pg_url, **config)) as b:
        key = await a.key("hoarder")
        client, other = a.client(key), b.client(key)
        stored = []
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(50):
                stored.append((await client.responses.create(model=MODEL, input="keep this " * 20,
                                                             max_output_tokens=8)).id)
        assert refused.value.code == "stored_bytes_exceeded" and 2 <= len(stored) < 50
        assert (await client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)).output_text
        neighbour = b.client(await b.key("neighbour"))
        assert (await neighbour.responses.create(model=MODEL, input="mine", max_output_tokens=2)).id
        await asyncio.sleep(0.3)  # (b's next refresh)
        with pytest.raises(openai.RateLimitError):
            await other.responses.create(model=MODEL, input="and on b?", max_output_tokens=2)

        for rid in stored[:2]:
            await other.responses.delete(rid)
        await asyncio.sleep(0.3)
        assert (await client.responses.create(model=MODEL, input="room again", max_output_tokens=2)).id
        async with a.gateway.db.connect() as conn:
            totals = dict((await conn.execute(text("SELECT app, bytes FROM stored_response_bytes"))).all())
            held = dict((await conn.execute(text(
                "SELECT app, SUM(size_bytes) FROM stored_responses GROUP BY app"))).all())
        assert totals["hoarder"] == held["hoarder"] and totals["neighbour"] == held["neighbour"] > 0


async def test_a_follow_up_over_its_limit_is_refused_before_its_conversation_is_read(sqlite_url):
    from fairgate.quota.quota_admin import set_quota

    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("agent")
        await set_quota(gw.admin, "agent", None, None, rpm=1)
        await gw.gateway.tenants.refresh()
        client = gw.client(key).with_options(max_retries=0)
        first = await client.responses.create(model=MODEL, input="a", max_output_tokens=2)
        store, reads = gw.gateway.responses, []
        chain = store.chain

        async def counted(*args):
            reads.append(args)
            return await chain(*args)

        store.chain = counted
        for _ in range(2):
            with pytest.raises(openai.RateLimitError):
                await client.responses.create(model=MODEL, input="b", previous_response_id=first.id)
        assert len(reads) == 1  # the first refusal read it; the next, refused at once, did not


async def test_a_response_its_client_leaves_is_billed_what_was_generated(sqlite_url):
    """A response asked for whole with no max_output_tokens is streamed from the backend and folded, as chat's
    is: a client that leaves before its answer is billed what was generated, not the model's whole context."""
    async with run_gateway(gateway_config(sqlite_url, emulated={"speed": 1.0})) as gw:
        key = await gw.key("agent")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1.5):
                    async with s.post(f"{gw.url}/v1/responses", json={"model": MODEL, "input": "Write " * 50}) as r:
                        await r.read()
        for _ in range(100):
            if rows := await gw.rows(endpoint="responses"):
                break
            await asyncio.sleep(0.05)
        [row] = rows
        assert row["status"] == "cancelled" and 0 < row["completion_tokens"] < 200, row  # (~30 a second)
        whole = await gw.client(key).responses.create(model=MODEL, input="Hi.", max_output_tokens=8)
        assert whole.status in ("completed", "incomplete") and 0 < whole.usage.output_tokens <= 8
        folded = await gw.client(key).responses.create(model=MODEL, input="A long story.")  # (streamed upstream)
        assert folded.id.startswith("resp_") and folded.output_text and folded.usage.output_tokens > 0
        assert (await gw.client(key).responses.retrieve(folded.id)).output_text == folded.output_text
