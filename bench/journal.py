"""What the usage journal adds per request: a row's JSON line and its write to the operating system (the fsync
is the writer's, once a second), in CPU time from ``getrusage`` (user and system).

    .venv/bin/python bench/journal.py [--rows 100000] [--fsync-s 1.0]

``--fsync-s 0`` syncs every row (``usage_journal_fsync_s: 0``), which costs what the disk's flush costs.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

import orjson

from fairgate.proxy.call import Call
from fairgate.storage.usage_journal import Journal


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--fsync-s", type=float, default=1.0)
    args = ap.parse_args()
    row = Call("req-0123456789abcdef", "chat", app="bench", user="u1").row()
    journal = Journal(tempfile.mkdtemp(prefix="fairgate-journal-") + "/journal", args.fsync_s)
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(args.rows):
        journal.append(orjson.dumps(row, default=str) + b"\n")
    t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    journal.close()
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    n = args.rows
    print(f"journal: {1e6 * (user + system) / n:.2f} µs CPU a row (user {1e6 * user / n:.2f}, system "
          f"{1e6 * system / n:.2f}), {1e6 * (t1 - t0) / n:.2f} µs wall; {len(orjson.dumps(row, default=str))} "
          f"bytes a line")


if __name__ == "__main__":
    main()
