"""`fairgate replay` under the SLO classes' priority bands (docs/simulator/replay.md): a tenant whose app's class is
``interactive`` is served before a ``batch`` one in the replay, as the gateway serves them, and the bands' minimum
shares hold; without classes the policy runs alone."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone

from tests.simhelp import write_usage_log

T0 = datetime(2026, 11, 3, 9, 0, tzinfo=timezone.utc)
# two apps, each a request every 0.4 s (1,000 prompt and 400 output tokens) for 80 s, onto one backend: each alone
# within what it serves, the two together beyond it
SENT = [(0.4 * i, 1000, 400) for i in range(200)]


def _write_log(url: str) -> None:
    write_usage_log(url, T0, [(app, at + offset, prompt, output) for app, offset in (("chat", 0.0), ("reports", 0.2))
                              for at, prompt, output in SENT])


def _cli(db: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args, "--database-url", db],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _waits(db: str) -> dict[str, float]:
    doc = json.loads(_cli(db, "replay", "--json", "--speed", "1", "--engine", "a100-llama2-7b"))
    return {key.split(":")[1].split("/")[0]: t["p90_wait_s"] for key, t in doc["replays"][0]["tenants"].items()}


def test_a_replay_serves_the_interactive_band_first_as_the_gateway_would(tmp_path):
    db = f"sqlite:///{tmp_path}/usage.db"
    _write_log(db)
    alone = _waits(db)  # no SLO class: VTC alone, both apps wait alike
    assert alone["chat"] > 5 and 0.5 < alone["chat"] / alone["reports"] < 2, alone

    for app in ("chat", "reports"):
        _cli(db, "admin", "app", "create", app)
    _cli(db, "admin", "slo", "set", "--app", "chat", "--class", "live", "--band", "interactive")
    _cli(db, "admin", "slo", "set", "--app", "reports", "--class", "bulk", "--band", "batch")
    banded = _waits(db)
    assert banded["chat"] < 0.3 * alone["chat"] and banded["reports"] > alone["reports"], (alone, banded)

    # a minimum share for the batch band: its tenant is served part of the time, and waits less than without it
    _cli(db, "admin", "slo", "set", "--app", "reports", "--class", "bulk", "--band", "batch", "--min-share", "0.4")
    shared = _waits(db)
    print(alone, banded, shared)
    assert shared["reports"] < banded["reports"] and shared["chat"] > banded["chat"], (banded, shared)
