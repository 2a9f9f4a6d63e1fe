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
from dataclasses import dataclass

import orjson

from fairgate.proxy.call import Call
from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.usage_journal import Journal
from fairgate.storage.usage_writer import UsageWriter


@dataclass
class Cost:
    user: float
    system: float
    wall: float

    def per_row(self, n: int) -> str:
        cpu, user, system = (1e6 * x / n for x in (self.user + self.system, self.user, self.system))
        wall = 1e6 * self.wall / n
        return f"{cpu:.2f} µs CPU a row (user {user:.2f}, system {system:.2f}), {wall:.2f} µs wall"


class Meter:
    def __enter__(self) -> Cost:
        self.r0, self.t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        self.cost = Cost(0.0, 0.0, 0.0)
        return self.cost

    def __exit__(self, *exc) -> None:
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        self.cost.user, self.cost.system = r1.ru_utime - self.r0.ru_utime, r1.ru_stime - self.r0.ru_stime
        self.cost.wall = t1 - self.t0


def rows(n: int, tag: str) -> list[dict]:
    """``n`` finished requests' rows, each its own request id (the database stores an id once)."""
    out = []
    for i in range(n):
        call = Call(f"req-{tag}-{i:016x}", "chat", app="bench", user=f"u{i % 100}")
        call.model, call.backend, call.http_status = "mock-llama", "gpu-0", 200
        call.tally.prompt_tokens, call.tally.completion_tokens = 52, 64
        out.append(call.row())
    return out


async def whole(args, tmp: str) -> tuple[Cost, int]:
    engine = make_engine(args.database_url or f"sqlite:///{tmp}/usage.db")
    await ensure_schema(engine)
    writer = UsageWriter(sessionmaker(engine), journal=Journal(f"{tmp}/whole/journal", args.fsync_s))
    batch = rows(args.rows, "whole-" + str(time.time_ns()))
    for row in rows(1000, "warm-" + str(time.time_ns())):  # (the statement compiled, the connection open)
        writer.submit(row)
    await writer.flush()
    with Meter() as cost:
        for k in range(0, len(batch), 1000):  # as a loaded gateway: a batch a writer round
            for row in batch[k:k + 1000]:
                writer.submit(row)
            await writer.flush()
    written = writer.written
    await writer.close()
    await engine.dispose()
    return cost, written


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--fsync-s", type=float, default=1.0)
    ap.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fairgate-usage-row-")
    row = rows(1, "line")[0]
    journal = Journal(f"{tmp}/journal", args.fsync_s)
    with Meter() as cost:
        for _ in range(args.rows):
            journal.append(orjson.dumps(row, default=str) + b"\n")
    journal.close()
    print(f"journal: {cost.per_row(args.rows)}; {len(orjson.dumps(row, default=str))} bytes a line")
    cost, written = asyncio.run(whole(args, tmp))
    print(f"the whole row (journaled, converted, inserted; {written - 1000} rows): {cost.per_row(args.rows)}")


if __name__ == "__main__":
    main()
