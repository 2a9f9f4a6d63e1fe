"""The VTC paper's synthetic experiments and its real trace, as named workloads
(docs/simulator/index.md#workloads)."""

from __future__ import annotations

import copy
from typing import Any


def _c(cid: str, arrival: dict[str, Any], inp: int = 256, out: int = 256, **kw: Any) -> dict[str, Any]:
    return {"id": cid, "arrival": arrival, "input_tokens": inp, "output_tokens": out, **kw}


def _u(rate: float) -> dict[str, Any]:
    return {"kind": "uniform", "rate": rate}


BUILTIN: dict[str, dict[str, Any]] = {
    # Fig 3: both overloaded, 90 and 180 rpm
    "overload": {"duration_s": 600, "clients": [_c("c1", _u(1.5)), _c("c2", _u(3.0))]},
    # Fig 4: proportional, 15 / 30 / 90 rpm
    "proportional": {"duration_s": 600, "clients": [_c("c1", _u(0.25)), _c("c2", _u(0.5)), _c("c3", _u(1.5))]},
    # Fig 5: client 1 ON/OFF under its share
    "on_off_less": {"duration_s": 600, "clients": [
        _c("c1", {"kind": "onoff", "rate": 0.5, "period_s": 60}), _c("c2", _u(2.0))]},
    # Fig 6: client 1 ON/OFF over its share
    "on_off_overload": {"duration_s": 600, "clients": [
        _c("c1", {"kind": "onoff", "rate": 2.0, "period_s": 60}), _c("c2", _u(3.0))]},
    # Fig 7: Poisson, short (64/64) vs long (256/256)
    "poisson_short_long": {"duration_s": 600, "clients": [
        _c("c1", {"kind": "poisson", "rate": 8.0}, 64, 64), _c("c2", {"kind": "poisson", "rate": 1.5})]},
    # Fig 8 as the artifact ran it (512 in / 32 out vs 32 in / 512 out) and as the caption says
    "poisson_in_out": {"duration_s": 600, "clients": [
        _c("c1", {"kind": "poisson", "rate": 8.0}, 512, 32), _c("c2", {"kind": "poisson", "rate": 1.5}, 32, 512)]},
    "poisson_in_out_paper": {"duration_s": 600, "clients": [
        _c("c1", {"kind": "poisson", "rate": 8.0}, 64, 512), _c("c2", {"kind": "poisson", "rate": 1.5}, 512, 64)]},
    # Fig 9: client 2 ramps from 12 to 120 rpm
    "increase": {"duration_s": 600, "clients": [
        _c("c1", _u(0.5)), _c("c2", {"kind": "ramp", "rate_start": 0.2, "rate_end": 2.0})]},
    # Fig 10: three 5-minute phases
    "dist_shift": {"duration_s": 900, "clients": [
        _c("c1", {"kind": "phases", "phases": [
            {"until": 300, "kind": "onoff", "rate": 0.5, "period_s": 60}, {"until": 600, "kind": "uniform", "rate": 1.0},
            {"until": 900, "kind": "uniform", "rate": 0.5}]}),
        _c("c2", {"kind": "phases", "phases": [
            {"until": 300, "kind": "uniform", "rate": 2.0}, {"until": 600, "kind": "uniform", "rate": 1.0},
            {"until": 900, "kind": "uniform", "rate": 1.5}]})]},
    # Fig 16: weights 1:2:3:4 (the weighted-VTC run's rates)
    "weighted": {"duration_s": 360, "clients": [
        _c(f"c{i + 1}", _u(r), weight=i + 1) for i, r in enumerate((0.4, 0.8, 1.2, 1.6))]},
    "weighted_equal": {"duration_s": 360, "clients": [
        _c(f"c{i + 1}", _u(r)) for i, r in enumerate((0.8, 0.8, 1.2, 1.6))]},
    # Fig 19 / Tables 5 and 6: length prediction
    "predict_2": {"duration_s": 360, "clients": [_c("c1", _u(1.5)), _c("c2", _u(3.0))]},
    "predict_8": {"duration_s": 360, "clients": [
        _c(f"c{i + 1}", _u(0.4 if i < 3 else 0.6)) for i in range(8)]},
    # Fig 15 ablation on an A100 / Llama-2-13B (M = 35 000; use --kv-tokens 65000 for the larger pool):
    # two clients at 1:2 with N-token prompts and outputs, rates as the artifact's exp_suite.py (M = 35 000)
    **{f"ablation_{n}": {"duration_s": 600, "engine": "a100-llama2-13b", "clients": [
        _c("c1", _u(r), n, n), _c("c2", _u(2 * r), n, n)]} for n, r in ((256, 3.0), (512, 1.5), (768, 1.0))},
    **{f"ablation65_{n}": {"duration_s": 600, "engine": "a100-llama2-13b", "clients": [
        _c("c1", _u(r), n, n), _c("c2", _u(2 * r), n, n)]} for n, r in ((256, 4.0), (512, 2.0), (768, 1.5))},
    # Table 2: the real LMSYS trace, 27 clients
    "real": {"duration_s": 600, "trace": {"path": "vtc-lmsys-27-clients.csv", "format": "vtc"}},
    # DLPM (claim C1 of docs/policies/locality.md#checks, Table 3 S2@LC-QA on one A10G): four clients asking
    # short questions about their own documents (8 each), all overloading the engine; c0 misbehaves with
    # documents 10× longer
    # (20,000 tokens: its 8 alone exceed the 120,000-token KV pool, so interleaving clients thrashes the cache)
    "dlpm_misbehaving": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 8.0}, 32, 16, prefix={"tokens": 20_000 if i == 0 else 2_000, "pool": 8})
        for i in range(4)]},
    # D²LPM (claims C2/C7, Table 3 S2@ToT) on 4 A10G-like engines (--backends 4): three clients sending
    # Tree-of-Thoughts programs (3 branches, depth 4: 120 calls each, a child after its parent), c0's question
    # 10× longer; each level adds a 32-token instruction
    "d2lpm_tot": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 0.75}, 5460 if i == 0 else 546, 64,
           tree={"branches": 3, "depth": 4, "turn_tokens": 32}) for i in range(3)]},
    # S2@LC-QA on 4 A10G-like engines (--backends 4; C2): dlpm_misbehaving's four clients at 4× the rate.
    # c0's 8 documents (160,000 tokens) do not fit one engine's KV pool: spreading each client over every
    # engine (VTC's per-client round robin) makes every engine thrash on them; routing by prefix does not
    "d2lpm_lcqa": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 32.0}, 32, 16, prefix={"tokens": 20_000 if i == 0 else 2_000, "pool": 8})
        for i in range(4)]},
    # S1@LC-QA on 4 engines: c0 floods (320 questions/s, 40× each other client's rate) over 8 documents of 4,000
    # tokens, like every client; the well-behaved clients stay far under their share
    "d2lpm_lcqa_flood": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 320.0 if i == 0 else 8.0}, 32, 16, prefix={"tokens": 4_000, "pool": 8})
        for i in range(4)]},
    # The same programs as Table 2/3 S2@ToT describe them (SGLang's GSM8K ToT): every program starts with one
    # instruction template (500 tokens, the same for every client) before its question (46 tokens; c0's 10×
    # longer), each call answers 256 tokens. Every root's match ratio is then above 0.5, so Preble's E2 rule
    # always exploits the backend that first cached the template (claim C6, Fig. 9's monopolisation)
    "d2lpm_tot_template": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 0.4}, 460 if i == 0 else 46, 256,
           prefix={"tokens": 500, "pool": 1, "group": "tot"}, tree={"branches": 3, "depth": 4, "turn_tokens": 32})
        for i in range(3)]},
    # LLM-as-a-judge (Table 2/3 S1@Judge): a system prompt and an article of ~2,700 tokens, k judgements of
    # up to 256 tokens, then a merge of them; c0 misbehaves with 16 dimensions, the others judge 2
    "dlpm_judge": {"duration_s": 30, "seed": 1, "engine": "a10g-llama3-3b", "clients": [
        _c(f"c{i}", {"kind": "poisson", "rate": 1.0}, 2700, {"dist": "uniform", "low": 64, "high": 256},
           judge={"dimensions": 16 if i == 0 else 2, "merge_output": 2}) for i in range(4)]},
}


def scaled(name: str, factor: float) -> dict[str, Any]:
    """A built-in workload with every arrival rate multiplied (to load N engines as one)."""
    data = copy.deepcopy(BUILTIN[name])

    def scale(arr: dict[str, Any]) -> None:
        for key in ("rate", "rate_start", "rate_end"):
            if key in arr:
                arr[key] *= factor
        for phase in arr.get("phases", ()):
            scale(phase)

    for c in data.get("clients", ()):
        scale(c["arrival"])
    return data
