"""The KV a request reserves on its backend (pipeline/reservation.py, accounting/length.py): with `reserve:
predicted` (the default) a kind of request seen often enough reserves the 0.9-quantile of its past outputs
instead of max_tokens, so more of them run at once, and a stream that outlives that reservation grows it; with
`reserve: max_tokens` each holds all it may produce. Nothing leaks either way."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest

from fairgate.accounting.length import OutputLengths
from tests.conftest import gateway_config, run_gateway

EMULATED = {"count": 1, "speed": 20.0, "kv_tokens": 3000, "mean_output": 40}


async def _ask(client, k: int, **kw) -> int:
    stream = await client.chat.completions.create(
        model="sim-llama", messages=[{"role": "user", "content": f"question number {k}"}], max_tokens=1000,
        stream=True, **kw)
    return sum([1 async for c in stream if c.choices and c.choices[0].delta.content])


async def _peak(gw, work) -> tuple[int, int]:
    """The most requests, and KV tokens, the gateway had on its backend while ``work`` ran."""
    backend, peak, tokens = gw.gateway.pool.backends[0], 0, 0
    task = asyncio.ensure_future(work)
    while not task.done():
        peak, tokens = max(peak, backend.inflight), max(tokens, backend.inflight_tokens)
        await asyncio.sleep(0.002)
    await task
    assert backend.inflight == 0 and backend.inflight_tokens == 0  # every reservation released
    return peak, tokens


@pytest.mark.parametrize("reserve", ["predicted", "max_tokens"])
async def test_predicted_reservations_run_more_at_once_and_grow_with_a_long_stream(sqlite_url, reserve):
    async with run_gateway(gateway_config(sqlite_url, emulated=EMULATED, reserve=reserve)) as gw:
        client = gw.client(await gw.key("chat"))
        lengths = [await _ask(client, k) for k in range(30)]  # one at a time: what such requests produce
        assert max(lengths) < 300 and len(set(lengths)) > 5
        peak, _ = await _peak(gw, asyncio.gather(*(_ask(client, 100 + k) for k in range(16))))
        if reserve == "max_tokens":
            assert peak <= 3  # ~1,010 tokens each in 3,000: two at their largest, and (kv_gate: future) a third
            # once those two have run 30 tokens (they will have ended before it reaches its largest)
            return
        assert peak >= 8, peak  # ~120 each
        _, held = await _peak(gw, _ask(client, 999, extra_body={"ignore_eos": True}))
        assert 900 < held <= 1100, held  # a 1,000-token stream grew its ~120-token reservation as it went


def test_the_prediction_is_a_quantile_and_grows_past_what_was_generated():
    lengths = OutputLengths(min_samples=20)
    assert lengths.upper("a", 0, 100) is None  # nothing seen: the caller reserves max_tokens
    for k in range(1, 101):
        lengths.observe("a", 0, 100, k)  # outputs 1..100 for ~100-token prompts
    p90 = lengths.upper("a", 0, 100)
    assert 90 <= p90 <= 110  # the 0.9-quantile, to its bucket's top (≤ 19 % over)
    assert lengths.upper("a", 0, 120) == p90  # the same prompt bucket (a factor of 2)
    assert lengths.upper("a", 0, 5000) == p90  # an unseen prompt length: the (app, stage) over all of them
    assert lengths.upper("a", 1, 100) is None and lengths.upper("b", 0, 100) is None
    beyond = lengths.upper_beyond("a", 0, 100, 95)
    assert 96 <= beyond <= 120
    assert lengths.upper_beyond("a", 0, 100, 500) is None  # longer than anything seen: max_tokens
    for _ in range(2000):
        lengths.observe("a", 0, 100, 10)  # the traffic changes: old observations fade
    assert lengths.upper("a", 0, 100) <= 12


def test_cut_outputs_count_as_at_least_that_long():
    """Outputs cut by their max_tokens are censored, not dropped: natural lengths ~ Exp(mean 128) under caps of
    10-200 tokens. Learning only the uncut ones learns lengths that fit under their caps (a median of about a
    third of the truth); counting the cut ones as "at least that long" (Kaplan-Meier) finds the median, and
    knows the 0.9-quantile lies beyond every natural length it saw (None: reserve all a request may produce)."""
    rng = random.Random(1)
    counted, dropped, natural = OutputLengths(), OutputLengths(), []
    for _ in range(4000):
        x, cap = 1 + int(rng.expovariate(1 / 128)), rng.randint(10, 200)
        natural.append(x)
        counted.observe("a", 0, 100, min(x, cap), cut=x >= cap)
        if x < cap:
            dropped.observe("a", 0, 100, x)
    median = sorted(natural)[len(natural) // 2]
    assert median <= counted.upper("a", 0, 100, 0.5) <= 1.2 * median + 1  # (to its bucket's top)
    assert dropped.upper("a", 0, 100, 0.5) < 0.6 * median
    assert counted.upper("a", 0, 100, 0.9) is None and dropped.upper("a", 0, 100, 0.9) < 200
    assert 0.8 * median < counted.mean("a", 0, 100) < 1.5 * statistics.fmean(natural)
    one = OutputLengths(min_samples=10)  # one huge max_tokens cut does not stretch the rest: each cut output
    for x, cut in [(100, False)] * 10 + [(150, True)] * 5 + [(4000, True)]:  # counts at its own length
        one.observe("b", 0, 100, x, cut=cut)
    assert one.mean("b", 0, 100) < 400 and one.mean_beyond("b", 0, 100, 120) < 1000


async def test_outputs_cut_at_one_token_teach_no_short_reservation(sqlite_url):
    """A user asking for 1 token 30 times must not teach the app that its requests produce 1 token (the next
    streams would reserve nothing and over-commit the backend): a cut output says only that it was at least that
    long."""
    async with run_gateway(gateway_config(sqlite_url, emulated=EMULATED)) as gw:
        client = gw.client(await gw.key("chat"))
        for k in range(30):
            stream = await client.chat.completions.create(
                model="sim-llama", messages=[{"role": "user", "content": f"question number {k}"}], max_tokens=1,
                stream=True)
            _ = [c async for c in stream]
        assert len(gw.gateway.lengths) > 0  # learnt, as cut
        peak, _ = await _peak(gw, asyncio.gather(*(_ask(client, 100 + k) for k in range(16))))
        assert peak <= 3  # nothing short learnt: max_tokens reserved (two, and a third once they have run a little)


def test_a_batch_of_prompts_reserves_for_every_choice_of_every_prompt():
    from types import SimpleNamespace

    from fairgate.accounting.tally import Tally
    from fairgate.proxy.pipeline.reservation import Reservations

    tally = Tally(0)
    tally.estimated_prompt = 400  # 4 prompts of 100 tokens
    call = SimpleNamespace(n=8, prompts=4, tally=tally)  # n = 2 for each of 4 prompts
    assert Reservations.most(call, SimpleNamespace(max_tokens=50, context_limit=4096)) == 400
    # no max_tokens: the rest of the context after each prompt, per choice
    assert Reservations.most(call, SimpleNamespace(max_tokens=None, context_limit=4096)) == 8 * (4096 - 100)
    assert Reservations.kv(call, SimpleNamespace(max_tokens=None, context_limit=4096), 10**9) == 8 * 4096


def test_the_future_gate_counts_what_the_running_requests_will_hold_together():
    """kv_gate: future (pipeline/kv_gate.py): two requests of 10 prompt + 1,000 output tokens on a 3,000-token
    backend leave no room for a third while they start (at iteration 1,000 all three would hold 1,010, counted
    in whole 16-token blocks), and do once one has generated 500 (it ends 500 iterations before the others reach their
    largest); ``peaks`` never does. What a replica tells the others is its requests' peak together, not the sum
    of their reservations. A request with n choices grows n tokens a step; one fetched whole shows no progress
    and counts at its largest."""
    from fairgate.policies.views import RequestView
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.dispatcher import GateConfig, Ticket
    from fairgate.proxy.pipeline.kv_gate import Gate, _items

    def ticket(k: int, **kw) -> Ticket:
        return Ticket(RequestView(f"r{k}", "c", "app", "m", 10, 1000), 1010, set(), None, 0.0, output=1000, **kw)

    clock = [0.0]
    gates = {mode: Gate(GateConfig(kv_gate=mode), None, lambda: clock[0]) for mode in ("future", "peaks")}
    for mode, gate in gates.items():
        clock[0] = 0.0
        b = Backend("b", "http://b", kv_capacity=3000)
        running = [ticket(0), ticket(1)]
        for t in running:
            b.acquire(t.kv_tokens)
            gate.running(b).add(t)
        assert not gate.headroom(b, ticket(2))
        running[0].generated = 500  # (charged as it streams)
        clock[0] += 0.5  # (the next heartbeat's view)
        assert gate.headroom(b, ticket(2)) == (mode == "future"), mode
        assert gate.committed(b) == (1012 + 516 if mode == "future" else 2020)  # (at the first one's last step)
        assert _items(ticket(3, choices=2)) == (500, 16, 2)  # (two choices of 500 steps, half the prompt each)
        whole = ticket(4, streamed=False)
        gate.running(b).add(whole)
        b.acquire(whole.kv_tokens)
        assert gate.committed(b) == (1012 + 516 + 1010 if mode == "future" else 3030)  # (whole: at its largest)
        running.append(whole)
        for t in running:
            gate.running(b).remove(t)
            b.release(t.kv_tokens)
        assert gate.committed(b) == 0


def test_the_gate_admits_within_its_budget_at_every_step_and_never_past_the_backend():
    """Across replicas a replica's KV budget on a backend is a number of KV tokens (storage/shared_state.py): the
    gate admits a request only if, at every future step, it fits beside this replica's requests within the
    budget, and within the backend's capacity (a budget that covers requests which outgrew it can pass it)."""
    from types import SimpleNamespace

    from fairgate.policies.views import RequestView
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.dispatcher import GateConfig, Ticket
    from fairgate.proxy.pipeline.kv_gate import Gate

    def ticket(k: int, output: int) -> Ticket:
        return Ticket(RequestView(f"r{k}", "c", "app", "m", 10, output), 10 + output, set(), None, 0.0, output=output)

    woken = []
    kv = SimpleNamespace(inflight={"b": (200, 1)}, budget={"b": 800}, holding={}, kept={})
    shared = SimpleNamespace(kv=kv, wake=lambda: woken.append(1), touch=lambda: None)
    gate = Gate(GateConfig(), shared, lambda: 0.0)
    b = Backend("b", "http://b", kv_capacity=1000)
    first = ticket(0, 600)
    b.acquire(first.kv_tokens)
    gate.running(b).add(first)
    # at its 400th step: 416 + 416, past the budget of 800 (the others hold the rest): the gate wants room
    assert not gate.headroom(b, ticket(1, 400)) and woken == [1]
    assert gate.headroom(b, ticket(2, 150))  # 166 + 166 at its end, then the first alone: 616
    assert gate.claims([b]) == {"b": (610, 1, 1000, True)}  # (told at the next sync: its request, wanting room)
    kv.budget["b"] = 1100
    assert gate.headroom(b, ticket(5, 400))  # 832
    assert not gate.headroom(b, ticket(6, 500))  # 1,032: within the budget, past the backend
    # while a sync is out it holds itself to what it said its requests hold too (its budget may be cut to that)
    kv.holding["b"] = 700
    assert gate.headroom(b, ticket(7, 40))  # (56 + 56 at its end, then the first alone)
    assert not gate.headroom(b, ticket(8, 400))  # 416 + 416 at its end: past 700, within the budget
    kv.holding.clear()
    kv.kept["b"] = 700  # and since a sync failed, to what it said at the first
    assert not gate.headroom(b, ticket(8, 400))


def test_a_replica_keeps_placing_requests_while_its_sync_is_out():
    """While a sync's answer is on its way a replica holds itself to what it claimed (its budget may be cut to
    that). It claims what its requests hold and, within its budget, as much again as it placed there since its
    last claim: at the pace it places requests it goes on placing them meanwhile, instead of queueing every
    request that comes during the round trip."""
    from types import SimpleNamespace

    from fairgate.policies.views import RequestView
    from fairgate.proxy.control.backends import Backend
    from fairgate.proxy.pipeline.dispatcher import GateConfig, Ticket
    from fairgate.proxy.pipeline.kv_gate import Gate

    def ticket(k: int) -> Ticket:
        return Ticket(RequestView(f"r{k}", "c", "app", "m", 10, 90), 100, set(), None, 0.0, output=90,
                      streamed=False)

    kv = SimpleNamespace(inflight={}, budget={"b": 10_000}, holding={}, kept={})
    gate = Gate(GateConfig(), SimpleNamespace(kv=kv, wake=lambda: None, touch=lambda: None), lambda: 0.0)
    b = Backend("b", "http://b", kv_capacity=100_000)
    placed = [ticket(k) for k in range(3)]
    for t in placed:
        assert gate.headroom(b, t)
        b.acquire(t.kv_tokens)
        gate.place(b, t)
    claim = gate.claims([b])["b"][0]
    assert claim == 300 + 300  # what they hold, and as much again as was placed since the last claim
    kv.holding["b"] = claim  # the sync is out
    for k in range(3, 6):  # three more are placed meanwhile
        t = ticket(k)
        assert gate.headroom(b, t)
        b.acquire(t.kv_tokens)
        gate.place(b, t)
    assert not gate.headroom(b, ticket(6))  # the seventh would pass what it claimed
    kv.holding.clear()  # the answer: its budget again
    assert gate.headroom(b, ticket(6))
    assert gate.claims([b])["b"][0] == 600 + 300  # the next claim: what they hold, and those placed since
    assert gate.claims([b])["b"][0] == 600  # (nothing placed since: what they hold)
    kv.budget["b"] = 700
    for k in range(7, 10):
        gate.place(b, ticket(k))
    assert gate.claims([b])["b"][0] == 700  # never past its budget (the others may hold the rest)


def test_the_gate_counts_a_stream_as_far_on_as_it_may_be_since_it_was_read():
    """The gate reads progress as the stream is relayed: an event loop held up, or a view a heartbeat old, is
    behind the backend. A stream counts as far on as its read rate may have taken it since its last read (in
    what it holds, its end where the read put it), and a newcomer checked against a view taken earlier ends
    that much later: both only ever count more than the backend holds."""
    from fairgate.policies.views import RequestView
    from fairgate.proxy.pipeline.dispatcher import Ticket
    from fairgate.proxy.pipeline.kv_gate import FutureKV, _items

    t = Ticket(RequestView("r", "c", "app", "m", 10, 100), 110, set(), None, 0.0, output=100, generated=20,
               rate=1000.0, charged_at=1.0)
    assert _items(t) == _items(t, now=1.0) == (80, 32, 1)  # 10 + 20 tokens, to a whole block
    assert _items(t, now=1.01) == (80, 48, 1)  # 10 ms at 1,000 tokens a second: 10 more, the same end
    assert _items(t, now=2.0) == (80, 112, 1)  # never past its reservation
    running = FutureKV(heartbeat_s=0.05)
    running.add(t)
    running.committed(1.0)  # the view, taken at 1.0
    assert running.since_view(1.0) == 0 and running.since_view(1.02) == 20


async def test_a_batch_of_many_prompts_counts_at_its_largest_in_the_future_gate():
    """A completion batching 200 prompts (× n) cannot grow the gate's profile by an item per choice: beyond 16
    choices a request counts at its largest, a fixed load (pipeline/kv_gate.py MAX_CHOICES)."""
    import asyncio

    from fairgate.policies.views import RequestView
    from fairgate.proxy.control.backends import Backend, BackendPool
    from fairgate.proxy.pipeline.dispatcher import Dispatcher
    from fairgate.policies.factory import make_placement, make_scheduler
    from fairgate.accounting.cost import LinearCost

    b = Backend("b", "http://b", kv_capacity=100_000, up=True, models={"m"})
    pool = BackendPool.__new__(BackendPool)
    pool.backends = [b]
    pool.candidates = lambda model, exclude=(): [b]
    d = Dispatcher(make_scheduler("fcfs", LinearCost(), lambda c: 1.0), pool, make_placement("least-load"))
    view = RequestView("r", "c", "app", "m", 200, 10)
    ticket = await asyncio.wait_for(d.acquire(view, 4200, output=4000, choices=400), 1)
    assert not ticket.streamed and d.gate.running(b).whole == 4200 and not d.gate.running(b)._shape
