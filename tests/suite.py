"""`make test`: the whole suite in three phases around one genuine vLLM server.

The servers — a generative model and a pooling (embedding) one — are launched first, so that their install (on a
fresh machine) and their boot overlap phase 1, which runs every other test on the xdist workers. Phase 2 then runs the vLLM tests alone. Run side by side with the rest
(the fuzz suite, on the other worker), vLLM on this 2-core machine held back its stream for seconds at a time,
/metrics included (a spinning process on the frontend's core was enough, even with vLLM at nice -10): a client
could not hang up mid-stream, and vLLM's gauges were sampled a handful of times per flood. Phase 3, with the
server stopped, runs the tests that judge latencies in wall time (marked ``alone``), two at a time, then the
live calibration (``solo``) by itself: beside a vLLM build and phase 1's workers their targets and predictions
were missed for the machine's reasons (a live calibration read 0.85 in one cold run of three).

    python -m tests.suite [--workers N] [PYTEST ARGS...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tests import vllm_server
from tests.browser import install_command as browser_install
from tests.conftest import free_port

VLLM_TESTS = "tests/test_vllm_e2e.py"


def _busy() -> tuple[int, int]:
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)  # (not idle, not iowait), all


def wait_for_quiet(limit_s: float = 90.0, busy_share: float = 0.15) -> float:
    """Wait (at most ``limit_s``) until two consecutive seconds in which the machine's CPUs were busy less than
    ``busy_share`` of the time: a stopped vLLM's processes wind down, a cold run's build ends. (A calibration
    read 0.866 once, straight after phase 2; 0.894-0.917 on a quiet machine.) Returns the seconds waited."""
    import time

    start, quiet = time.monotonic(), 0
    if not os.path.exists("/proc/stat"):
        return 0.0
    while quiet < 2 and time.monotonic() - start < limit_s:
        b0, t0 = _busy()
        time.sleep(1.0)
        b1, t1 = _busy()
        quiet = quiet + 1 if (b1 - b0) < busy_share * max(1, t1 - t0) else 0
    return time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", default="3")
    args, extra = ap.parse_known_args()
    # The suite starts many Python processes (gateways, emulated backends, CLI runs), each importing fairgate:
    # with PYTHONDONTWRITEBYTECODE set (as on some machines) each compiled its modules again (~0.35 s of CPU
    # a process). The bytecode is cached in __pycache__ (ignored by git and by the image's build context).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    pytest = [sys.executable, "-m", "pytest", "-q", *extra]
    # Debian's chromium for the console's browser test, installed (if missing) while phase 1 runs; the test
    # waits on the same lock (tests/browser.py)
    browser = subprocess.Popen(browser_install(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = vllm_server.VLLMServer.launch(free_port(), *vllm_server.E2E_ARGS, kv_events_port=free_port())
    pooling = vllm_server.VLLMServer.launch_pooling(free_port())  # (its install waits for the first's)
    try:
        first = subprocess.run([*pytest, "-n", args.workers, "--dist", "loadfile", "-m", "not vllm and not alone"])
        print(f"\nphase 2: the genuine-vLLM tests, alone ({VLLM_TESTS})", flush=True)
        # the launched servers, for the module's fixtures: they wait for /health (install and boot included)
        env = {**os.environ, vllm_server.ENV_LAUNCHED: server.to_env(),
               vllm_server.ENV_LAUNCHED_POOLING: pooling.to_env()}
        second = subprocess.run([*pytest, "-m", "vllm", VLLM_TESTS], env=env)
    finally:
        server.stop()
        pooling.stop()
    print("\nphase 3: the tests that judge latencies in real time, on a quiet machine", flush=True)
    print(f"(the machine was quiet after {wait_for_quiet():.0f} s)", flush=True)
    # two at a time (one used about half of the machine: most of their time is the floods' wall time; one after
    # the other they took 5.5 min, two at a time 3 min with the same margins), then the live calibration by
    # itself (side by side with another flood it read 0.86 once, against 0.89-0.92)
    pair = [] if args.workers in ("0", "1") else ["-n", "2", "--dist", "loadfile"]  # (-n auto too: two)
    third = subprocess.run([*pytest, *pair, "-m", "alone and not solo"])
    fourth = subprocess.run([*pytest, "-m", "solo"])
    browser.wait()
    return first.returncode or second.returncode or third.returncode or fourth.returncode


if __name__ == "__main__":
    sys.exit(main())
