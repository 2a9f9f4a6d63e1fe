"""Latency targets in the simulator (sim/targets.py) and `fairgate plan` (sim/planner.py): what attains an SLO, the
simulation JSON's ``slo``, and the fewest workers a workload needs — checked against simulations one worker
short."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fairgate.sim.planner import fewest_workers, rate_of, rescale
from fairgate.sim.targets import Slo, SloError, attained, atgt, parse, summary
from fairgate.sim.workload import SimRequest, WorkloadError, from_dict


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def workload(rate: float, default_slo: dict | None = None, **client) -> dict:
    doc = {"duration_s": 20, "seed": 7, "clients": [
        {"id": "a", "arrival": {"kind": "poisson", "rate": rate}, "input_tokens": 256, "output_tokens": 64,
         **client}]}
    if default_slo is not None:
        doc["slo"] = default_slo
    return doc


@pytest.mark.parametrize("spec", [[], "fast", {"ttft_s": -1}, {"ttft_s": 0}, {"atgt_s": True},
                                  {"ttft_s": "0.4"}, {"ttft_s": math.inf}, {"p99": 1}, {}])
def test_a_malformed_slo_is_refused_with_its_place(spec):
    with pytest.raises(SloError):
        parse(spec)
    with pytest.raises(WorkloadError, match="client a: slo"):
        from_dict(workload(1.0, slo=spec))


def test_what_attains_an_slo():
    slo = Slo(ttft_s=0.5, atgt_s=0.02)

    def req(first, finished, generated, **kw):
        r = SimRequest(0, "a", 10.0, 100, generated, **kw)
        r.first_token, r.finished, r.generated = first, finished, generated
        return r

    assert attained(req(10.4, 11.4, 51), slo)  # TTFT 0.4, ATGT 1.0 / 50 = 0.02
    assert not attained(req(10.6, 11.0, 51), slo)  # TTFT 0.6: queueing counts
    assert not attained(req(10.4, 11.5, 51), slo)  # ATGT 0.022
    assert attained(req(10.4, 10.4, 1), slo) and atgt(req(10.4, 10.4, 1)) == 0.0  # one token: nothing to average
    assert not attained(req(None, None, 0), slo)  # never answered
    assert not attained(req(10.1, 10.2, 2, rejected=True), slo)
    cancelled = req(None, None, 0, cancelled=True)  # never sent: not judged
    doc = summary([req(10.4, 11.4, 51), req(10.6, 11.0, 51), cancelled], lambda c: slo)
    assert doc["attainment"] == 0.5 and doc["slos"] == 2 and doc["met"] == 1
    assert summary([req(10.4, 11.4, 51)], lambda c: None) == {"attainment": 1.0, "slos": 0}


def test_the_simulation_reports_attainment_per_client_and_overall(tmp_path):
    """A light client meets its targets; a flooding one, on the same engine, does not meet its own; only the
    clients with targets are judged."""
    doc = {"duration_s": 20, "seed": 7, "clients": [
        {"id": "light", "slo": {"ttft_s": 30, "atgt_s": 0.2}, "arrival": {"kind": "poisson", "rate": 0.5},
         "input_tokens": 128, "output_tokens": 32},
        {"id": "flood", "slo": {"ttft_s": 0.5}, "arrival": {"kind": "poisson", "rate": 30},
         "input_tokens": 1024, "output_tokens": 256},
        {"id": "free", "arrival": {"kind": "poisson", "rate": 0.5}, "input_tokens": 64, "output_tokens": 16}]}
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(doc))
    out = cli("simulate", "--workload", str(path), "--policy", "vtc", "--mode", "gateway", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    clients, slo = result["clients"], result["slo"]
    assert clients["light"]["slo_attainment"] == 1.0
    assert clients["flood"]["slo_attainment"] < 0.2
    assert "slo_attainment" not in clients["free"]
    judged = clients["light"]["requests"] + clients["flood"]["requests"]
    assert slo["slos"] == judged and 0 < slo["attainment"] < 1 and slo["met"] < judged
    assert slo["ttft_p99_s"] > 0.5 and slo["atgt_p99_s"] > 0


def test_a_prompt_the_model_cannot_take_is_refused_and_a_long_output_ends_with_its_context():
    """As vLLM serves a model of 4,096 tokens: a prompt that leaves no room for one token is refused (the
    client's error, counted apart, not a target missed on any pool), and a trace's output that would run past
    the context stops where it ends (finish "length")."""
    from fairgate.accounting.cost import make_cost
    from fairgate.engine.profiles import get_profile
    from fairgate.sim.setup import simulator_for

    one = {"arrival": {"kind": "poisson", "rate": 0.5}}
    w = from_dict({"duration_s": 20, "seed": 3, "engine": "a100-llama2-7b", "slo": {"ttft_s": 5, "atgt_s": 0.1},
                   "clients": [{"id": "over", "input_tokens": 4096, "output_tokens": 8, **one},
                               {"id": "edge", "input_tokens": 4000, "output_tokens": 500, **one},
                               {"id": "short", "input_tokens": 100, "output_tokens": 50, **one}]})
    simulator_for(w, "vtc", "least-load", get_profile("a100-llama2-7b"), mode="gateway", backends=2,
                  cost=make_cost("weighted")).run()
    by = {c: [r for r in w.requests if r.client == c] for c in ("over", "edge", "short")}
    assert all(by.values())
    assert all(r.rejected and r.throttle_reason == "context_length_exceeded" and r.generated == 0
               for r in by["over"])
    assert all(r.finished is not None and r.generated == r.output_len == 96 for r in by["edge"])
    assert all(r.finished is not None and r.generated == 50 for r in by["short"])
    doc = summary(w.requests, w.slo_for)
    assert doc["over_context"] == len(by["over"])
    assert doc["slos"] == len(by["edge"]) + len(by["short"]) and doc["attainment"] == 1.0


def test_the_search_doubles_then_bisects():
    calls = []

    def run_at(need):
        def attainment_run(k):
            calls.append(k)

            class W:  # what plan reads of a filled workload
                requests = [SimRequest(0, "a", 0.0, 1, 1)]
            r = W.requests[0]
            r.first_token, r.finished, r.generated = (0.1, 0.2, 1) if k >= need else (None, None, 0)
            W.slo_for = staticmethod(lambda c: Slo(1.0))
            return W
        return attainment_run

    assert fewest_workers(run_at(13), 0.99, 64) == (13, 1.0)
    assert calls == [1, 2, 4, 8, 16, 12, 14, 13]  # O(log W) runs
    calls.clear()
    assert fewest_workers(run_at(100), 0.99, 64) == (None, 0.0) and calls[-1] == 64


def test_rescaling_keeps_the_requests_and_moves_the_rate():
    w = from_dict(workload(2.0))
    n, first = len(w.requests), [r.arrival for r in w.requests]
    rescale(w, 2 * rate_of(w))
    assert len(w.requests) == n and rate_of(w) == pytest.approx(2 * n / 20)
    assert [r.arrival for r in w.requests] == pytest.approx([t / 2 for t in first])
    with pytest.raises(ValueError):
        rescale(w, 0)


@pytest.mark.slow
def test_plan_finds_the_fewest_workers_that_meet_the_target(tmp_path):
    """`fairgate plan --json` answers W for each placement; a simulation on W workers meets the target and one
    on W − 1 does not."""
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(workload(12.0)))
    out = cli("plan", "--workload", str(path), "--slo-ttft", "1.0", "--slo-atgt", "0.06", "--placement",
              "least-load", "--placement", "round-robin", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["placement"] for r in rows] == ["least-load", "round-robin"]
    for row in rows:
        assert row["workers"] is not None and row["workers"] > 1 and row["attainment"] >= 0.99
        assert row["rate"] == pytest.approx(rate_of(from_dict(workload(12.0))))
        for k, meets in ((row["workers"], True), (row["workers"] - 1, False)):
            doc = json.loads(path.read_text())
            doc["slo"] = {"ttft_s": 1.0, "atgt_s": 0.06}
            p = tmp_path / f"{row['placement']}-{k}.yaml"
            p.write_text(json.dumps(doc))
            sim = cli("simulate", "--workload", str(p), "--mode", "gateway", "--backends", str(k),
                      "--placement", row["placement"], "--json")
            assert (json.loads(sim.stdout)["slo"]["attainment"] >= 0.99) is meets, (row, k)


def test_plan_takes_a_placements_parameters_and_says_what_the_context_refused(tmp_path):
    """``--placement NAME:KEY=NUMBER,…`` plans that variant (a row named as given); prompts the engine's context
    cannot take are counted in each row and warned of, not planned for silently; a parameter the placement
    does not have is refused."""
    doc = workload(4.0)
    doc["clients"].append({"id": "long", "arrival": {"kind": "poisson", "rate": 0.5}, "input_tokens": 5000,
                           "output_tokens": 16})
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(doc))
    out = cli("plan", "--workload", str(path), "--slo-ttft", "1.0", "--slo-atgt", "0.06", "--placement",
              "least-load", "--placement", "power-of-two:seed=3", "--max-workers", "8", "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    longs = sum(r.client == "long" for r in from_dict(doc).requests)
    assert [r["placement"] for r in rows] == ["least-load", "power-of-two:seed=3"]
    assert longs > 0 and all(r["over_context"] == longs and r["workers"] is not None for r in rows)
    assert f"warning: {longs} of the requests have prompts of 4,096 tokens or more" in out.stderr
    bad = cli("plan", "--workload", str(path), "--slo-ttft", "1.0", "--placement", "aladdin:pack=1,depth=2")
    assert bad.returncode != 0 and "aladdin has no parameter depth" in bad.stderr


def test_plan_over_several_rates_fits_eq_7_and_draws_it(tmp_path):
    """`--rate` repeated: a plan per rate, Eq. 7's line W = k5·λ + c5 fitted with its R² (check A11), and with
    `--out` the document and the plot written."""
    from fairgate.sim.planner import scaling

    assert scaling([(1, 2), (2, 4), (4, 8)]) == pytest.approx({"k5": 2.0, "c5": 0.0, "r2": 1.0})
    assert scaling([(1, 2), (2, 4)]) is None and scaling([(1, 2), (1, 3), (1, 4)]) is None
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(workload(4.0)))
    out = cli("plan", "--workload", str(path), "--slo-ttft", "1.0", "--slo-atgt", "0.06", "--rate", "2",
              "--rate", "4", "--rate", "8", "--json", "--out", str(tmp_path / "plan"))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [r["rate"] for r in doc["rows"]] == pytest.approx([2, 4, 8])
    workers = [r["workers"] for r in doc["rows"]]
    assert workers == sorted(workers) and workers[-1] > workers[0]  # more traffic, more workers
    fit = doc["scaling"]["least-load"]
    assert fit["k5"] > 0 and 0 <= fit["r2"] <= 1
    assert json.loads((tmp_path / "plan" / "plan.json").read_text()) == doc
    assert (tmp_path / "plan" / "workers-vs-rate.png").stat().st_size > 10_000


def test_plan_refuses_what_it_cannot_plan(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text(json.dumps(workload(2.0)))
    for args, says in ((["--target", "1.5"], "--target"), (["--slo-ttft", "-1"], "--slo-ttft"),
                       (["--rate", "0", "--slo-ttft", "1"], "--rate"), ([], "no latency targets")):
        out = cli("plan", "--workload", str(path), *args)
        assert out.returncode != 0 and says in out.stderr + out.stdout, (args, out.stderr)


async def test_plan_from_the_usage_log_sizes_the_pool_for_the_traffic_the_gateway_served(sqlite_url):
    """`fairgate plan --from-usage` replays the served requests of the usage log (their arrivals, lengths, apps
    and tenants) and answers as for a workload; a window holding nothing is refused plainly."""
    import asyncio

    from fairgate.sim.from_log import workload_from_log
    from tests.conftest import gateway_config, run_gateway

    async with run_gateway(gateway_config(sqlite_url, emulated={"count": 1, "speed": 50.0})) as gw:
        client = gw.client(await gw.key("chat"))

        async def ask(k: int) -> None:
            await client.chat.completions.create(model="sim-llama", max_tokens=20 + k, user=f"u{k % 3}",
                                                 messages=[{"role": "user", "content": "hello " * (5 + k)}])

        await asyncio.gather(*(ask(k) for k in range(24)))
        rows = await gw.rows()  # (written)
    w = workload_from_log(rows)
    assert len(w.requests) == 24 and {r.app for r in w.requests} == {"chat"} and len(w.clients) == 3
    assert sorted(r.output_len for r in w.requests) == sorted(r["completion_tokens"] for r in rows)
    out = await asyncio.to_thread(cli, "plan", "--from-usage", "1h", "--slo-ttft", "30", "--json",
                                  "--database-url", sqlite_url)
    assert out.returncode == 0, out.stderr
    [row] = json.loads(out.stdout)["rows"]
    assert row["placement"] == "least-load" and row["workers"] == 1 and row["attainment"] >= 0.99
    empty = await asyncio.to_thread(cli, "plan", "--from-usage", "2020-01-01", "--until", "2020-01-02",
                                    "--slo-ttft", "1", "--database-url", sqlite_url)
    assert empty.returncode != 0 and "no served request" in empty.stderr + empty.stdout
    both = await asyncio.to_thread(cli, "plan", "--from-usage", "1h", "--workload", "overload", "--slo-ttft", "1",
                                   "--database-url", sqlite_url)
    assert both.returncode != 0 and "one of --workload and --from-usage" in both.stderr + both.stdout


def test_only_requests_that_were_served_whole_are_replayed_from_the_log():
    from fairgate.sim.from_log import workload_from_log

    rows = [{"arrival": "2026-11-25T10:00:00+00:00", "status": "ok", "app": "a", "user": "u", "stage": 0,
             "prompt_tokens": 100, "completion_tokens": 50, "fairness_key": "user:a/u"},
            {"arrival": "2026-11-25T10:00:01+00:00", "status": "error", "app": "a", "user": "u", "stage": 0,
             "prompt_tokens": 100, "completion_tokens": 3, "fairness_key": "user:a/u"},  # cut mid-stream
            {"arrival": "2026-11-25T10:00:02+00:00", "status": "cancelled", "app": "a", "user": None, "stage": None,
             "prompt_tokens": 100, "completion_tokens": 2, "fairness_key": None},
            {"arrival": "2026-11-25T10:00:03+00:00", "status": "ok", "app": "b", "user": None, "stage": None,
             "prompt_tokens": 10, "completion_tokens": 5, "fairness_key": None}]
    w = workload_from_log(rows)
    assert [(r.client, r.arrival, r.prompt_len, r.output_len) for r in w.requests] == [
        ("user:a/u", 0.0, 100, 50), ("b/-", 3.0, 10, 5)]
    out = cli("plan", "--workload", "overload", "--until", "1h", "--slo-ttft", "1")
    assert out.returncode != 0 and "--until goes with --from-usage" in out.stderr + out.stdout
