"""The policy contract: what a scheduler and a placement may be asked and what they declare, held by every
policy the gateway runs; the stores behind a policy, memory or Redis, satisfy one Protocol each; the
dispatcher reads declarations and never probes; and a policy written against the contract alone (the docs'
example, tests/example_policy.py) runs in the live gateway."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path

import pytest

from fairgate.accounting.cost import LinearCost
from fairgate.policies.counters import CounterStore, MemoryCounters
from fairgate.policies.factory import LIVE_POLICIES, make_placement, make_scheduler
from fairgate.policies.interactions import InteractionStore, MemoryInteractions
from fairgate.policies.placement import PLACEMENTS, Placement
from fairgate.policies.scheduler import Scheduler
from fairgate.policies.windows import MemoryWindows, WindowStore
from fairgate.storage.shared_state import SharedState
from tests.conftest import gateway_config, run_gateway
from tests.example_policy import ClientRoundRobin

ROOT = Path(__file__).resolve().parent.parent
CAPABILITIES = ("throttles", "skips_unfit", "prefetches", "keeps_counters")


def test_every_live_policy_and_placement_answers_the_contract():
    for name in LIVE_POLICIES:
        s = make_scheduler(name, LinearCost(), lambda _c: 1.0)
        assert isinstance(s, Scheduler), name
        assert all(isinstance(getattr(s, c), bool) for c in CAPABILITIES), name
        for method, params in (("peek", ("now", "eligible", "backend", "queued")), ("pop", ("req", "now", "backend")),
                               ("on_finish", ("req", "generated", "now", "prompt_tokens", "cached_tokens"))):
            assert tuple(inspect.signature(getattr(s, method)).parameters)[:len(params)] == params, (name, method)
        if s.keeps_counters:
            assert isinstance(s.counters, CounterStore), name
    for name in PLACEMENTS:
        p = make_placement(name)
        assert isinstance(p, Placement) and isinstance(p.routes_at_arrival, bool), name


def test_the_memory_and_redis_stores_satisfy_one_protocol_each():
    shared = SharedState("redis://127.0.0.1:6379/0", "contract")
    for store, protocol in ((MemoryCounters(), CounterStore), (shared, CounterStore),
                            (MemoryWindows(), WindowStore), (shared.windows(60.0), WindowStore),
                            (MemoryInteractions(), InteractionStore), (shared.interactions(), InteractionStore)):
        assert isinstance(store, protocol), (type(store).__name__, protocol.__name__)
    asyncio.run(shared.redis.aclose())


def test_the_dispatcher_reads_declarations_and_never_probes():
    tree = ast.parse((ROOT / "fairgate" / "proxy" / "pipeline" / "dispatcher.py").read_text())
    probes = [n.lineno for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert not probes, f"getattr/hasattr at lines {probes}"


async def test_a_policy_written_against_the_contract_runs_in_the_gateway(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        gw.gateway.dispatcher.switch(ClientRoundRobin())
        clients = [gw.client(await gw.key("chat", user=u)) for u in ("ann", "bob")]
        answers = await asyncio.gather(*(c.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            for c in clients for _ in range(3)))
        assert [a.usage.completion_tokens for a in answers] == [2] * 6
        assert len(gw.gateway.dispatcher.scheduler) == 0


async def test_a_running_request_settles_with_the_policy_that_admitted_it(sqlite_url):
    """A live switch hands the waiting requests to the new policy; a request already running is charged, as it
    streams and at its end, by the one that admitted it — whose queue is empty by then."""
    async with run_gateway(gateway_config(sqlite_url, policy="vtc")) as gw:
        client = gw.client(await gw.key("chat", user="ann"))
        admitted_by = gw.gateway.dispatcher.scheduler
        stream = await client.chat.completions.create(
            model="sim-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=24, stream=True,
            stream_options={"include_usage": True})
        chunks = [await stream.__anext__()]  # (running: its first token came)
        switched_to = make_scheduler("vtc", LinearCost("weighted", 1.0, 2.0), lambda _c: 1.0)
        gw.gateway.dispatcher.switch(switched_to)
        chunks += [c async for c in stream]
        usage = chunks[-1].usage
        assert usage.completion_tokens == 24
        charged = dict(admitted_by.counters.items())
        assert list(charged.values()) == [pytest.approx(usage.prompt_tokens + 2 * 24)], charged
        assert not dict(switched_to.counters.items())
