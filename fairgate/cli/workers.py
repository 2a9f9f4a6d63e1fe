"""``fairgate serve --workers N``: N gateway processes on one host sharing the listening port (SO_REUSEPORT: the
kernel spreads new connections over them), each a replica of the others through Redis (counters, FairServe's
windows, the prefix index), exactly as gateways on several hosts are. This process only supervises: it starts
them, forwards SIGTERM/SIGINT (each drains its requests), and if one dies it stops the rest and exits with
that worker's status, so a process manager restarts the whole set."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def supervise(argv: list[str], workers: int) -> int:
    """Run ``fairgate serve`` ``argv`` (without --workers) as ``workers`` processes with --reuse-port, their
    metrics in one fresh multiprocess directory (a scrape of any worker reads every worker's; the counters of
    a worker that exits stay in the sums, so they never go backwards while this set runs)."""
    metrics = tempfile.mkdtemp(prefix="fairgate-metrics-")
    try:
        return _run([sys.executable, "-m", "fairgate.cli.main", "serve", *argv, "--reuse-port"], workers,
                    {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics})
    finally:
        shutil.rmtree(metrics, ignore_errors=True)


def _run(base: list[str], workers: int, env: dict[str, str]) -> int:
    procs = [subprocess.Popen([*base, "--worker-index", str(k)], env=env) for k in range(workers)]
    stopping = False

    def forward(sig, _frame) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return status
        dead = [c for c in codes if c is not None]
        if dead and not stopping:  # one worker died: the set goes down together
            status = next(c for c in dead if c is not None) or 1
            forward(signal.SIGTERM, None)
        time.sleep(0.2)
