"""What a request's usage row costs the gateway, in CPU time from ``getrusage`` (user and system, every
thread: SQLite's runs in its own): its journal line (the JSON line and its ``write`` to the operating system;
the fsync is the writer's, once a second), and then the whole row as the gateway keeps it — journaled,
converted for the driver and inserted by the usage writer in batches into a fresh database of the current
schema, its audit indexes included.

    .venv/bin/python bench/usage_row.py [--rows 100000] [--fsync-s 1.0] [--database-url …]

``--fsync-s 0`` syncs every row (``usage_journal_fsync_s: 0``), which costs what the disk's flush costs. The
default database is a fresh SQLite file, as ``fairgate serve`` ships; a PostgreSQL URL measures that (its
server's own CPU is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import tempfile
import time

import orjson

from fairgate.proxy.call import Call
from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.usage_journal import Journal
from fairgate.storage.usage_writer import UsageWriter


def _since(r0, t0: float, n: int) -> str:
    """CPU (user + system, every thread) and wall time per row since ``getrusage`` gave ``r0`` at ``t0``."""
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    user, system = 1e6 * (r1.ru_utime - r0.ru_utime) / n, 1e6 * (r1.ru_stime - r0.ru_stime) / n
    wall = 1e6 * (t1 - t0) / n
    return f"{user + system:.2f} µs CPU a row (user {user:.2f}, system {system:.2f}), {wall:.2f} µs wall"


def rows(n: int, tag: str) -> list[dict]:
    """``n`` finished requests' rows, each its own request id (the database stores an id once)."""
    out = []
    for i in range(n):
        call = Call(f"req-{tag}-{i:016x}", "chat", app="bench", user=f"u{i % 100}")
        call.model, call.backend, call.http_status = "mock-llama", "gpu-0", 200
        call.tally.prompt_tokens, call.tally.completion_tokens = 52, 64
        out.append(call.row())
    return out


async def whole(args, tmp: str) -> str:
    engine = make_engine(args.database_url or f"sqlite:///{tmp}/usage.db")
    await ensure_schema(engine)
    writer = UsageWriter(sessionmaker(engine), journal=Journal(f"{tmp}/whole/journal", args.fsync_s))
    batch = rows(args.rows, "whole-" + str(time.time_ns()))
    for row in rows(1000, "warm-" + str(time.time_ns())):  # (the statement compiled, the connection open)
        writer.submit(row)
    await writer.flush()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for k in range(0, len(batch), 1000):  # as a loaded gateway: a batch a writer round
        for row in batch[k:k + 1000]:
            writer.submit(row)
        await writer.flush()
    cost = _since(r0, t0, len(batch))
    written = writer.written - 1000
    await writer.close()
    await engine.dispose()
    return f"{cost}; {written} rows written"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--fsync-s", type=float, default=1.0)
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fairgate-usage-row-")
    row = rows(1, "line")[0]
    journal = Journal(f"{tmp}/journal", args.fsync_s)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.rows):
        journal.append(orjson.dumps(row, default=str) + b"\n")
    cost = _since(r0, t0, args.rows)
    journal.close()
    print(f"journal: {cost}; {len(orjson.dumps(row, default=str))} bytes a line")
    print(f"the whole row (journaled, converted, inserted): {asyncio.run(whole(args, tmp))}")


if __name__ == "__main__":
    main()
