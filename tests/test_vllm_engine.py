"""The engine with vLLM v1's KV admission (engine/vllm_engine.py): it admits on what a request holds now, preempts
the last admitted when a step lacks room, and a preempted stream goes on where it stopped."""

from __future__ import annotations

import asyncio

import aiohttp
from openai import AsyncOpenAI

from fairgate.proxy.control.backends import parse_vllm_metrics
from fairgate.engine.batching import Engine, EngineRequest
from fairgate.engine.profiles import get_profile
from fairgate.engine.serve import start_emulator
from fairgate.engine.vllm_engine import PreemptingEngine

PROFILE = get_profile("a10g-llama2-7b").with_overrides(kv_tokens=1000)


def _drain(engine: Engine, requests: list[EngineRequest]) -> tuple[list[float], dict[str, list[int]]]:
    """Run to the end: the KV use after each step, and each request's token counts as they were emitted."""
    for r in requests:
        engine.add(r)
    now, use, seen = 0.0, [], {r.id: [] for r in requests}
    while not engine.idle:
        step = engine.step(now)
        now += step.duration
        use.append(engine.kv_used_tokens)
        for r in step.emitted:
            seen[r.id].append(r.generated)
    return use, seen


def test_it_admits_on_the_present_and_preempts_the_last_admitted_when_a_step_lacks_room():
    requests = [EngineRequest(id=str(i), prompt_len=100, output_len=200) for i in range(8)]
    engine = PreemptingEngine(PROFILE)
    use, seen = _drain(engine, requests)
    assert engine.preemptions_total > 0
    assert max(use) <= PROFILE.kv_tokens  # never more KV than it holds
    for r in requests:  # every stream got each of its tokens once, in order, however often it was preempted
        assert seen[r.id] == list(range(1, 201)) and r.done
    first = requests[0]  # the first admitted is never the one preempted while others run
    assert first.finished_at == min(r.finished_at for r in requests)
    # a resumed request is recomputed, not admitted anew: its prompt counts once, as its first lookup found it
    assert engine.prompt_tokens_total == 8 * 100 and all(r.cached_tokens == 0 for r in requests)

    reserving = Engine(PROFILE)  # the future-reserving engine runs the same requests with none preempted
    future = [EngineRequest(id=str(i), prompt_len=100, output_len=200) for i in range(8)]
    use_future, _ = _drain(reserving, future)
    assert reserving.preemptions_total == 0
    assert sum(use) / len(use) > sum(use_future) / len(use_future)  # and fills less of its KV


def test_what_fits_whole_runs_as_on_the_reserving_engine():
    """Requests whose whole futures fit together: nothing to preempt, the same steps as ``Engine``."""
    make = lambda: [EngineRequest(id=str(i), prompt_len=50, output_len=60) for i in range(6)]  # noqa: E731
    engine, reserving = PreemptingEngine(PROFILE), Engine(PROFILE)
    assert _drain(engine, make()) == _drain(reserving, make())
    assert engine.preemptions_total == 0


async def test_the_emulator_preempts_and_says_so_in_its_metrics_and_streams_complete():
    emu = await start_emulator(speed=20, kv_tokens=600, admission="vllm")
    try:
        client = AsyncOpenAI(base_url=emu.url + "/v1", api_key="none")

        async def one(i: int) -> int:
            stream = await client.chat.completions.create(
                model="sim-llama", messages=[{"role": "user", "content": f"{i} tell me"}], max_tokens=120,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            assert usage.completion_tokens == 120 and len(text.split()) == 120
            return usage.completion_tokens

        assert await asyncio.gather(*(one(i) for i in range(10))) == [120] * 10
        await client.close()
        engine = emu.server.runner.engine
        assert engine.preemptions_total > 0
        async with aiohttp.ClientSession() as s, s.get(emu.url + "/metrics") as r:
            text = await r.text()
        line = f'vllm:num_preemptions_total{{engine="0",model_name="sim-llama"}} {float(engine.preemptions_total)}'
        assert line in text
        assert parse_vllm_metrics(text)  # the gateway still reads the rest
    finally:
        await emu.stop()
