"""Start emulated vLLM servers (in-process, or as the `fairgate backend-sim` command)."""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from fairgate.engine.profiles import get_profile
from fairgate.engine.openai_server import EmulatedVLLM, SimConfig


@dataclass
class Emulator:
    runner: web.AppRunner
    url: str
    server: EmulatedVLLM

    async def stop(self) -> None:
        await self.runner.cleanup()

    @property
    def kv_events(self) -> str | None:
        """The endpoint its KV events are published on (None: it publishes none)."""
        return self.server.kv_events.endpoint if self.server.kv_events else None


async def start_emulator(*, host: str = "127.0.0.1", port: int = 0, model: str = "sim-llama",
                         profile: str = "a10g-llama2-7b", speed: float = 1.0, kv_tokens: int | None = None,
                         max_num_seqs: int | None = None, mean_output: int = 128, seed: int = 0,
                         kv_events: str | None = None, admission: str = "future") -> Emulator:
    """Start one emulated backend on ``host:port`` (0: any free port). ``admission``: ``future`` reserves every
    running request's future (no preemption); ``vllm`` admits and preempts as vLLM v1 does (engine/vllm_engine.py)."""
    prof = get_profile(profile).with_overrides(kv_tokens=kv_tokens, max_num_seqs=max_num_seqs)
    server = EmulatedVLLM(prof, SimConfig(model=model, speed=speed, mean_output=mean_output, seed=seed,
                                                   kv_events=kv_events, admission=admission))
    runner = web.AppRunner(server.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return Emulator(runner, f"http://{host}:{runner.addresses[0][1]}", server)


async def start_emulated(config, kv_events: bool = False) -> list[Emulator]:
    """The gateway's embedded backends (``emulated`` in its config), publishing KV events if asked."""
    return [await start_emulator(model=config.model, profile=config.profile, speed=config.speed,
                                 kv_tokens=config.kv_tokens, max_num_seqs=config.max_num_seqs,
                                 mean_output=config.mean_output, seed=i,
                                 kv_events="tcp://127.0.0.1:0" if kv_events else None,
                                 admission=config.admission)
            for i in range(config.count)]
