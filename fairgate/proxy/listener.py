"""The public listener: aiohttp's runner with the limits a gateway facing many tenants needs.

- ``max_connections``: a connection beyond the limit is closed as it is accepted (aiohttp has no limit);
- ``header_timeout_s``: aiohttp's keep-alive timer runs from the moment a connection is made and is reset only
  by a finished response, so a client must deliver a request's headers within it (slowloris) — and an idle
  keep-alive connection is closed after it;
- the body is read under ``body_timeout_s`` by the gateway (``app.py``: 408);
- the objects of the start are frozen out of the garbage collector's full passes (``gc.freeze``);
- SIGTERM or SIGINT: stop accepting, let requests finish for ``drain_s``, cancel the rest, run the cleanup.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal

from aiohttp import web

log = logging.getLogger("fairgate")


def limit_connections(server: web.Server, limit: int) -> None:
    registered = server.connection_made

    def connection_made(handler, transport) -> None:
        if len(server.connections) >= limit:
            log.warning("connection limit (%d) reached: a new connection is closed", limit)
            transport.abort()
            return
        registered(handler, transport)

    server.connection_made = connection_made  # type: ignore[method-assign]


async def serve(app: web.Application, host: str, port: int, *, drain_s: float, max_connections: int,
                header_timeout_s: float, reuse_port: bool = False) -> None:
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_s,
                           keepalive_timeout=header_timeout_s)
    await runner.setup()
    assert runner.server is not None
    limit_connections(runner.server, max_connections)
    await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
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
        log.info("stopping: no new connections; requests may finish for %.0f s", drain_s)
    finally:
        await runner.cleanup()
