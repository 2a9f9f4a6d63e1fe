"""The public listener's life: the gateway started, the edge (``edge.py``) accepting, and on SIGTERM or SIGINT
a drain — stop accepting, let requests finish for ``drain_s``, cancel the rest, then stop the gateway (its last
usage rows written). The objects of the start are frozen out of the garbage collector's full passes."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket

from fairgate.proxy.app import Gateway
from fairgate.proxy.config import GatewayConfig

log = logging.getLogger("fairgate")


def _unlogged_lost_lookups(loop: asyncio.AbstractEventLoop, context: dict) -> None:
    """The loop's handler of errors nobody retrieved, but for a name lookup left behind by a connection attempt
    that timed out (uvloop's): it fails later with the error its caller already got, and said (an unresolvable
    Redis host would otherwise print a traceback per attempt, several a second)."""
    if isinstance(context.get("exception"), socket.gaierror) and "never retrieved" in context.get("message", ""):
        return
    loop.default_exception_handler(context)


async def serve(config: GatewayConfig, host: str, port: int, *, reuse_port: bool = False) -> None:
    asyncio.get_running_loop().set_exception_handler(_unlogged_lost_lookups)
    async with Gateway.open(config) as gateway:
        edge = gateway.edge()
        await edge.start(host, port, reuse_port=reuse_port)
        log.info("serving on http://%s:%d", host, port)
        # what the start loaded (modules, the tokenizer's tables, the ORM, the configuration) lives as long as the
        # process: kept out of the collector's sight, a full collection scans only the requests' objects (under
        # load, 60-100 ms pauses every few seconds became ~2 ms ones: the p99's tail)
        gc.collect()
        gc.freeze()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            log.info("stopping: no new connections; requests may finish for %.0f s", gateway.config.drain_s)
        finally:
            await edge.shutdown(gateway.config.drain_s)
