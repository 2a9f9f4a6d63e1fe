"""What a tenant sends cannot steer what the gateway trusts, and no value it sends can stop the audit log:
hostile ids and headers get a 400 (or are clamped) and every request still leaves its row; a
row the database refuses anyway is isolated and dead-lettered, not retried forever; the client's request id
is never a key; interactions are scoped to their user; max_tokens beyond the context never queues."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import aiohttp
import orjson

from tests.conftest import gateway_config, run_gateway

CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


async def _post(gw, key: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(gw.url + "/v1/chat/completions", data=json.dumps(body),
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                                   **(headers or {})}) as r:
            return r.status, await r.json(content_type=None), {k.lower(): v for k, v in r.headers.items()}


async def test_hostile_values_get_400_and_never_stop_the_usage_log(db_url):
    """Once, the first of these got a 200 and every later usage batch failed forever."""
    huge = "99999999999999999999"
    hostile = [  # (body changes, headers, expected status)
        ({}, {"X-Fairgate-Stage": huge}, 400),
        ({}, {"X-Fairgate-Stage": "64"}, 400),
        ({}, {"X-Fairgate-Stage": "-1"}, 400),
        ({}, {"x-stainless-retry-count": huge}, 200),  # informational: clamped, not refused
        ({"safety_identifier": {"a": 1}}, {}, 400),
        ({"user": "u" * 300}, {}, 400),
        ({"user": "nul\x00byte"}, {}, 400),
        ({}, {"X-Fairgate-User": "tab\tin-name"}, 400),
        ({}, {"X-Fairgate-Interaction": "i" * 300}, 400),
        ({"n": 10**12}, {}, 400),
        ({"max_tokens": 2**40}, {}, 400),
        ({"seed": 2**70}, {}, 400),  # beyond 64 bits: not JSON the gateway (or vLLM) reads
        # a role that is not a string (an object is unhashable: it was a 500, found by fuzzing the spec)
        ({"messages": [{"role": {"a": 1}, "content": "x"}]}, {}, 400),
        ({"messages": [{"role": ["user"], "content": "x"}]}, {}, 400),
        # ids that would reach logs and metric labels raw: line separator, C1 control, bidi override
        ({"user": "line\u2028sep"}, {}, 400),
        ({"user": "c1\u0085"}, {}, 400),
        ({}, {"X-Fairgate-Interaction": "bidi\u202eevil".encode().decode("latin-1")}, 400),
        # the header and the body name different users (the backend would see one, the queue the other)
        ({"user": "bob"}, {"X-Fairgate-User": "alice"}, 400),
    ]
    async with run_gateway(gateway_config(db_url)) as gw:
        key = await gw.key("tenant")
        for change, headers, expected in hostile:
            status, body, _ = await _post(gw, key, {**CHAT, **change}, headers)
            assert status == expected, (change, headers, status, body)
            if status == 400:
                assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        status, _, _ = await _post(gw, key, {**CHAT, "user": "after"})
        assert status == 200
        rows = await gw.rows()  # asserts the flush wrote everything
        assert len(rows) == len(hostile) + 1 and gw.gateway.writer.pending == 0
        assert gw.gateway.writer.failures == 0 and gw.gateway.writer.dead == 0
        assert rows[3]["client_retry"] == 100 and rows[-1]["user"] == "after" and rows[-1]["status"] == "ok"


async def test_a_row_the_database_refuses_is_dead_lettered_and_the_rest_written(pg_url, tmp_path):
    """Rows are fitted to their columns (NUL bytes, over-long ids, out-of-range integers); one that cannot be
    converted goes to the dead-letter file as it is queued, and one that the database refuses anyway is found by
    splitting the batch and goes there too."""
    from fairgate.proxy.call import Call
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.usage_queries import rows as all_rows
    from fairgate.storage.usage_writer import USAGE_INSERT, UsageWriter

    engine = make_engine(pg_url)
    await ensure_schema(engine)
    dead = tmp_path / "dead.jsonl"
    writer = UsageWriter(sessionmaker(engine), batch_size=16, dead_letter=dead)
    for i in range(20):
        row = Call(f"r{i}", "chat", app="a", user="x" * 1000, stage=2**40, interaction="in\x00teraction").row()
        if i == 7:
            row["arrival"] = "not a time"  # nothing a client sends can do this; a bug could
        writer.submit(row)
        if i == 11:  # converted, yet refused by the driver: a row the database cannot take
            bad = list(writer._buf[-1])
            bad[USAGE_INSERT.index(engine.dialect, "arrival")] = "not a time"
            writer._buf[-1] = tuple(bad)
    assert await writer.flush() and writer.pending == 0
    written = await all_rows(writer.sessions)
    assert sorted(r["request_id"] for r in written) == sorted(f"r{i}" for i in range(20) if i not in (7, 11))
    assert {(len(r["user"]), r["stage"], r["interaction"]) for r in written} == {(256, 2**31 - 1, "interaction")}
    assert [orjson.loads(line)["row"]["request_id"] for line in dead.read_bytes().splitlines()] == ["r7", "r11"]
    assert writer.dead == 2
    writer.submit(Call("later", "chat", app="a", arrival=datetime.now(timezone.utc)).row())
    assert await writer.flush()  # the log goes on
    await engine.dispose()


async def test_a_repeated_request_id_is_echoed_but_charged_once_per_request(sqlite_url):
    """Four concurrent requests with one x-request-id: four rows, four charges (once: 2,400 of 8,400
    tokens were charged, and queued duplicates were orphaned)."""
    async with run_gateway(gateway_config(sqlite_url, policy="vtc")) as gw:
        key = await gw.key("tenant", user="dup")
        results = await asyncio.gather(*(_post(gw, key, {**CHAT, "max_tokens": 50}, {"x-request-id": "same-id"})
                                         for _ in range(4)))
        assert [(status, headers["x-request-id"]) for status, _, headers in results] == [(200, "same-id")] * 4
        rows = await gw.rows()
        assert len({r["request_id"] for r in rows}) == 4 and {r["client_request_id"] for r in rows} == {"same-id"}
        assert all(r["completion_tokens"] == 50 for r in rows)
        charged = sum(r["prompt_tokens"] + 2 * r["completion_tokens"] for r in rows)  # weighted cost, w_p=1 w_q=2
        assert gw.gateway.scheduler.counter("user:tenant/dup") == charged


async def test_an_interaction_id_is_scoped_to_its_user(sqlite_url):
    """Another user repeating a known interaction id starts its own interaction (its stages count from 0)."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("agents")  # an app key, naming its users
        for user in ("alice", "alice", "mallory"):
            status, _, _ = await _post(gw, key, {**CHAT, "user": user}, {"X-Fairgate-Interaction": "run-1"})
            assert status == 200
        rows = await gw.rows()
        assert [(r["user"], r["interaction"], r["stage"]) for r in rows] == [
            ("alice", "run-1", 0), ("alice", "run-1", 1), ("mallory", "run-1", 0)]


async def test_a_database_outage_keeps_known_keys_working_and_gives_unknown_keys_503(sqlite_url):
    """Once the key cache served nothing stale: within 5 s of the database going away every request
    got a 500 and left no row. Now a known key keeps working (its row waits for the database) and an unknown
    key gets 503 with retry-after."""
    from fairgate.storage.db import make_engine, sessionmaker

    async with run_gateway(gateway_config(sqlite_url, identity_cache_ttl_s=0.0)) as gw:
        known = await gw.key("tenant", user="k")
        assert (await _post(gw, known, CHAT))[0] == 200
        unknown = await gw.key("tenant", user="u")  # valid, but never looked up before the outage
        down = make_engine("postgresql://nobody@127.0.0.1:1/none")  # nothing listens on port 1
        gw.gateway.keys.sessions = sessionmaker(down)
        try:
            status, _, _ = await _post(gw, known, CHAT)
            assert status == 200 and gw.gateway.keys.stale_answers == 1
            status, body, headers = await _post(gw, unknown, CHAT)
            assert status == 503 and body["error"]["code"] == "identity_unavailable"
            assert headers["retry-after"] == "1"
        finally:
            await down.dispose()
        rows = await gw.rows()
        assert [(r["user"], r["status"]) for r in rows] == [("k", "ok"), ("k", "ok")]


async def test_queues_are_capped_per_tenant_and_in_total(sqlite_url):
    """One tenant cannot fill the gateway's memory with waiting requests (429 tenant_queue_full), nor all
    tenants together (503 queue_full); both with retry-after, both with a usage row."""
    cfg = gateway_config(sqlite_url, policy="vtc", max_queued=3, max_queued_per_tenant=2,
                         emulated={"count": 1, "max_num_seqs": 1, "speed": 5.0})
    async with run_gateway(cfg) as gw:
        a, b = await gw.key("t", user="a"), await gw.key("t", user="b")
        body = {**CHAT, "max_tokens": 40}
        flood = [asyncio.create_task(_post(gw, a, body)) for _ in range(4)]  # 1 runs, 2 wait, 1 is refused
        await asyncio.sleep(0.3)
        others = [asyncio.create_task(_post(gw, b, body)) for _ in range(2)]  # 1 waits (3 in all), 1 refused
        results = await asyncio.gather(*flood, *others)
        codes = sorted((status, (resp.get("error") or {}).get("code")) for status, resp, _ in results)
        assert codes == [(200, None)] * 4 + [(429, "tenant_queue_full"), (503, "queue_full")], codes
        assert all("retry-after" in h for s, _, h in results if s != 200)
        assert len(await gw.rows()) == 6
        assert gw.gateway.dispatcher._queued == {}


async def test_a_huge_prompt_is_tokenized_off_the_event_loop(sqlite_url, monkeypatch):
    """A 6 MB prompt takes tiktoken about half a second; it is counted in a worker thread (tiktoken releases
    the GIL), not on the loop every stream shares (once the loop stalled for the whole count: measured
    here, the loop's longest tick gap was 0.47 s with the count inline and below 0.25 s in the thread)."""
    import threading

    from fairgate.accounting.tokenizer import Tokenizer
    from fairgate.proxy.config import BackendConfig
    from tests.fault_backend import fault_backend

    counted_on: list[int] = []
    original = Tokenizer.count_chat

    def spy(self, messages, *args):
        counted_on.append(threading.get_ident())
        return original(self, messages, *args)

    monkeypatch.setattr(Tokenizer, "count_chat", spy)
    text = "the quick brown fox jumps over the lazy dog " * 140_000  # ≈ 6.2 MB
    async with fault_backend() as (_, url), run_gateway(gateway_config(  # a backend that does not tokenize
            sqlite_url, backends=[BackendConfig(url=url, name="b")])) as gw:
        key = await gw.key()
        for content in ("short", text):
            status, _, _ = await _post(gw, key, {"model": "ok", "messages": [{"role": "user", "content": content}],
                                                 "max_tokens": 1})
            assert status == 200
        rows = await gw.rows()
    loop_thread = threading.get_ident()
    assert counted_on[0] == loop_thread and counted_on[1] != loop_thread  # small inline, huge in a thread
    assert rows[1]["estimated_prompt_tokens"] > 1_000_000
