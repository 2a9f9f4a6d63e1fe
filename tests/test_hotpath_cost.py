"""What a request costs the gateway as shipped stays what it was: instructions per non-streamed request, and per
stream, of ``fairgate serve`` with no flags (info logs, the access log, the default policy; SQLite, in-memory state), counted
by callgrind (``bench/instructions.py``), which the machine's load does not move the way it moves seconds. A
change that makes every request dearer by more than 10 % fails here rather than in a bench nobody ran."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from bench.instructions import count

BASELINE = Path(__file__).parent / "data" / "hotpath_instructions.json"
GROWTH = 1.10

# beside the other tests (phase 1): callgrind counts instructions, whatever else the machine does; the tests
# that judge latencies in wall time, which its busy core once moved, run alone in the last phase
pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("kind", ["whole", "stream"])
def test_a_request_costs_no_more_instructions_than_its_recorded_baseline(kind):
    assert shutil.which("valgrind"), "valgrind is needed (Debian's valgrind package) to count instructions"
    base = json.loads(BASELINE.read_text())
    base = base if kind == "whole" else base["stream"]
    got = asyncio.run(count(requests=base["requests"], concurrency=base["concurrency"], warmup=base["warmup"],
                            stream=kind == "stream", chunk_delay_ms=base.get("chunk_delay_ms", 0.0)))
    ratio = got["per_request"] / base["per_request"]
    what = "a non-streamed request" if kind == "whole" else "a stream"
    print(f"{what}: {got['per_request'] / 1e6:.3f} M instructions, {ratio:.2f}× the baseline "
          f"({base['per_request'] / 1e6:.3f} M, {base['date']})")
    assert ratio <= GROWTH, (
        f"{what} costs {got['per_request']:,} instructions, {ratio:.2f}× its baseline "
        f"{base['per_request']:,} ({BASELINE.name}): find what grew (bench/instructions.py --keep FILE, then "
        f"callgrind_annotate), or, if the cost is deliberate, record the new figure there and say why")
