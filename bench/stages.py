"""``fairgate serve`` with some of the stages that close a request left out, to measure what each costs: the
instructions (``bench/instructions.py --skip``) and the CPU (``bench/hotpath.py --skip``) of a request with and
without them. A measuring tool, never a way to run the gateway: a request it serves may leave no usage row,
no access record, or no metrics and statistics of its end. One process only: ``--workers`` would start
workers without the stages left out, and is refused.

    python bench/stages.py STAGE[,STAGE…] serve [serve's options]

- ``usage_row``: the usage row (``UsageWriter.submit``): its journal line, its conversion for the database's
  driver and its insert;
- ``access_log``: the access record (``AccessLog.record``; as ``access_log: false`` in the configuration);
- ``statistics``: the metrics and what a request's end teaches the gateway (``Gateway._observe``: FairServe's
  app statistics, the output lengths its reservations predict, the TTFT forecasts' calibration, the mean
  lengths).

What is left is the request's own path: the edge, its key, its validation and prompt count, the limits, the
fair queue and the dispatch, the backend's call and the relay with its exact charge.

Two more are a stream's, paid on every read (``bench/instructions.py --stream --chunk-delay-ms 10 --skip …``):

- ``read_charge``: the read's charge (``Reservations.charge``: the policy's counter, the reservation grown
  past its prediction); the stream is then charged for its prompt alone until its end settles it;
- ``read_fit``: the latency fit's read (``LatencyFits.stream_read``).
"""

from __future__ import annotations

import sys

STAGES = ("usage_row", "access_log", "statistics", "read_charge", "read_fit")


def skip(stages: list[str]) -> None:
    from fairgate.logs import AccessLog
    from fairgate.proxy.app import Gateway
    from fairgate.proxy.control.latency_fits import LatencyFits
    from fairgate.proxy.pipeline.reservation import Reservations
    from fairgate.storage.usage_writer import UsageWriter

    unknown = set(stages) - set(STAGES)
    if unknown:
        raise SystemExit(f"unknown stages {sorted(unknown)}: of {', '.join(STAGES)}")
    nothing = lambda *args, **kw: None  # noqa: E731
    if "usage_row" in stages:
        UsageWriter.submit = nothing
    if "access_log" in stages:
        AccessLog.record = nothing
    if "statistics" in stages:
        Gateway._observe = nothing
    if "read_charge" in stages:
        Reservations.charge = nothing
    if "read_fit" in stages:
        LatencyFits.stream_read = nothing


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    if any(arg.startswith("--workers") for arg in sys.argv[2:]):
        raise SystemExit("bench/stages.py measures one process: --workers would run its workers unchanged")
    skip([s for s in sys.argv[1].split(",") if s])
    from fairgate.cli.main import main as fairgate

    sys.argv = ["fairgate", *sys.argv[2:]]
    fairgate()


if __name__ == "__main__":
    main()
