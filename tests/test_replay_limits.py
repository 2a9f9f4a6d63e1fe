"""`fairgate replay --limits` (docs/simulator/replay.md#limits-and-budgets): what last week would have looked like
under other limits — each replayed request meets its app's and user's limits as it arrives, on the same meters as
the gateway's quota gate, and is refused with the limit's reason when one would pass its cap."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest

from fairgate.accounting.cost import LinearCost
from fairgate.sim.limits import LimitTable, SimLimits
from fairgate.sim.workload import SimRequest
from tests.simhelp import write_usage_log

T0 = datetime(2026, 11, 2, 9, 0, tzinfo=timezone.utc)
BURST = [(0.5 * i, 100, 50) for i in range(60)]  # app "burst": 2 requests a second of 150 tokens, for 30 s
STEADY = [(1.0 * i + 0.25, 100, 50) for i in range(30)]  # app "steady": 1 a second


def _req(i: int, app: str, user: str = "", prompt: int = 100, output: int = 50) -> SimRequest:
    return SimRequest(i, f"user:{app}/{user}", 0.0, prompt, output, app=app, user=user)


def test_a_request_limit_refuses_past_its_cap_and_drains_as_a_minute_passes():
    limits = SimLimits(LimitTable.parse({"app:a": {"rpm": 2}}), LinearCost(), T0.timestamp())
    assert [limits.admit(_req(i, "a", "u"), 0.0) for i in range(3)] == [None, None, "app_rpm"]
    assert limits.admit(_req(3, "b", "u"), 0.0) is None  # another app: not its limit
    assert limits.admit(_req(4, "a", "v"), 29.0) == "app_rpm"  # (1.97 of 2 still used)
    assert limits.admit(_req(5, "a", "v"), 31.0) is None  # half a minute drained one


def test_concurrency_is_given_back_when_a_request_ends_and_a_policy_refusal_gives_back_all():
    limits = SimLimits(LimitTable.parse({"user:a/u": {"concurrency": 1, "tpm": 1000}}), LinearCost(),
                       T0.timestamp())
    first = _req(0, "a", "u")
    assert limits.admit(first, 0.0) is None
    assert limits.admit(_req(1, "a", "u"), 0.1) == "user_concurrency"
    limits.ended(first, 1.0)
    second = _req(2, "a", "u", prompt=700)
    assert limits.admit(second, 1.0) is None  # 150 + 750 tokens of 1,000
    limits.refused(second, 1.0)  # (the policy throttled it after: nothing of it stays on the meters)
    assert limits.admit(_req(3, "a", "u", prompt=700), 1.0) is None


@pytest.mark.parametrize("doc,error", [
    ([1, 2], "a mapping"),
    ({"tenant:x": {"rpm": 1}}, "app:NAME or user:APP/NAME"),
    ({"app:a": {"rpm": -1}}, "rpm is a positive whole number"),
    ({"app:a": {"rpm": True}}, "rpm is a positive whole number"),
    ({"app:a": {"tpm": 1.5}}, "tpm is a positive whole number"),
    ({"app:a": {"burst": 3}}, "limits are a mapping of"),
    ({"app:a": {"tpm_kind": "tokens"}}, "tpm_kind is total"),
    ({"app:a": {"budget_usd": 5.0}}, "money budgets are not replayed"),
    ({"app:a": {"tpm": 10**400}}, "tpm is a positive whole number"),
    ({"app:a": {"budget_period": "year"}}, "budget_period is day"),
])
def test_a_limits_file_that_does_not_parse_is_named(doc, error):
    with pytest.raises(ValueError, match=error):
        LimitTable.parse(doc)


def _rows(sent: list[tuple[float, str]]) -> list[dict]:
    """Usage rows as the log holds them: (seconds after T0, user), each served in a second."""
    return [{"request_id": f"r{i}", "app": "a", "user": user, "fairness_key": f"user:a/{user}", "interaction": "",
             "stage": 0, "status": "ok", "prompt_tokens": 100, "completion_tokens": 50,
             "arrival": T0 + timedelta(seconds=at), "dispatched_at": T0 + timedelta(seconds=at),
             "finished_at": T0 + timedelta(seconds=at + 1), "backend": "gpu-0"} for i, (at, user) in enumerate(sent)]


def test_a_request_the_policy_refuses_after_its_limits_admitted_it_holds_nothing():
    """Under ``rpm:1`` the policy refuses the second request of a minute after the user's concurrency cap let
    it in: what it reserved there is given back, and the requests of later minutes are served."""
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.from_log import workload_from_log
    from fairgate.sim.log_replay import Setup, simulate

    table = LimitTable.parse({"user:a/u": {"concurrency": 1}})
    served = simulate(workload_from_log(_rows([(0, "u"), (1, "u"), (100, "u"), (500, "u")])),
                      Setup("rpm:1", "least-load", 1), get_profile("a100-llama2-7b"), limits=table,
                      epoch0=T0.timestamp())
    assert [s.refused for s in served] == [False, True, False, False]


def _write_log(url: str) -> None:
    write_usage_log(url, T0, [(app, at, prompt, output) for app, sent in (("burst", BURST), ("steady", STEADY))
                              for at, prompt, output in sent])


def _replay(db: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "replay", "--database-url", db, "--json",
                           "--speed", "1", "--engine", "a100-llama2-7b", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _leaky_bucket(sent: list[tuple[float, int, int]], cap: float) -> int:
    """Requests a token limit of ``cap`` a minute refuses: a meter of what was admitted, draining cap / 60 a second."""
    used, last, refused = 0.0, 0.0, 0
    for at, prompt, output in sent:
        used, last = max(0.0, used - cap / 60 * (at - last)), at
        if used + prompt + output > cap:
            refused += 1
        else:
            used += prompt + output
    return refused


def test_a_replay_under_a_token_limit_refuses_what_the_limit_would_have(tmp_path):
    db = f"sqlite:///{tmp_path}/usage.db"
    _write_log(db)
    free = _replay(db)
    assert free["replays"][0]["refused_interactions"] == 0
    limits = tmp_path / "limits.yaml"
    limits.write_text("app:burst: {tpm: 3000}\n")
    limited = _replay(db, "--limits", str(limits))["replays"][0]
    expected = _leaky_bucket(BURST, 3000)
    assert 20 <= expected <= 40 and limited["refused_interactions"] == expected  # (each request its own)
    served = {k: t["service"] for k, t in limited["tenants"].items()}
    # (the steady app, unlimited, is served as before: its requests a little sooner beside a lighter batch)
    assert served["user:steady/u"] == pytest.approx(free["replays"][0]["tenants"]["user:steady/u"]["service"],
                                                    rel=0.01)
    assert served["user:burst/u"] < 0.75 * free["replays"][0]["tenants"]["user:burst/u"]["service"]

    # without --limits, the limits set in the database now
    for command in (["app", "create", "burst"], ["limit", "set", "--app", "burst", "--tpm", "3000"]):
        done = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "admin", *command, "--database-url", db],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    assert _replay(db)["replays"][0]["refused_interactions"] == expected

    bad = tmp_path / "bad.yaml"
    bad.write_text("app:burst: {tpm: lots}\n")
    done = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "replay", "--database-url", db,
                           "--limits", str(bad)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "tpm is a positive whole number" in done.stderr
