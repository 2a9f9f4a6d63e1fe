"""What the suite's genuine vLLM costs the machine it shares with the tests (tests/vllm_server.py): the seconds to
its first healthy /health and the CPU its process group took until then, then its CPU over a minute idle.
``--compiled`` boots it without ``--enforce-eager`` (torch.compile, as vLLM starts by default).

    .venv/bin/python bench/vllm_boot.py [--compiled] [--pooling]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import vllm_server  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def group_cpu(pgid: int) -> float:
    """CPU seconds (user + system, with reaped children's) of the live processes of a process group."""
    ticks = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            ticks += sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compiled", action="store_true", help="without --enforce-eager")
    ap.add_argument("--pooling", action="store_true", help="the pooling (embedding) server")
    ap.add_argument("--idle-s", type=float, default=60.0)
    args = ap.parse_args()
    if args.pooling:
        flags, model, name = vllm_server.POOLING_ARGS, "tiny-model", vllm_server.POOLING_NAME
    else:
        flags, model, name = vllm_server.E2E_ARGS, "tiny-slow", vllm_server.SERVED_NAME
    if args.compiled:
        flags = tuple(f for f in flags if f != "--enforce-eager")
    vllm_server.install()  # (not counted: the boot alone)
    t0 = time.monotonic()
    server = vllm_server.VLLMServer.launch(free_port(), *flags, model=model, name=name)
    try:
        server.wait()
        ready_s, boot = time.monotonic() - t0, group_cpu(server.pgid)
        time.sleep(args.idle_s)
        idle = group_cpu(server.pgid) - boot
    finally:
        server.stop()
    print(json.dumps({"server": name, "flags": flags, "ready_s": round(ready_s, 1), "boot_cpu_s": round(boot, 1),
                      "idle_cpu_s_per_min": round(idle * 60 / args.idle_s, 1)}))


if __name__ == "__main__":
    main()
