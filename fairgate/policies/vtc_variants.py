"""VTC's variants (docs/policies/vtc.md): LCF, VTC without the counter lift, and VTC with length prediction
(Algorithm 3, §4.4). Pure, as every policy."""

from __future__ import annotations

from typing import Callable

from fairgate.accounting.cost import CostFunction
from fairgate.policies.counters import CounterStore
from fairgate.policies.scheduler import Weights
from fairgate.policies.views import RequestView
from fairgate.policies.vtc import VTC, _Charged


class LCF(VTC):
    """Least Counter First: VTC without the counter lift (a returning client keeps its lagging counter)."""

    name = "lcf"
    lift = False


class VTCPredict(VTC):
    """VTC with length prediction, Algorithm 3 (§4.4): charge h(n_p, pred) at admission, charge tokens beyond
    the prediction as they come, refund an over-prediction at the end.

    ``predict(req)`` gives the prediction: the per-client EMA (``vtc-predict``), the true length
    (``vtc-oracle``, simulator only), or the true length ±50% (App. B.3).
    """

    name = "vtc-predict"

    def __init__(self, predict: Callable[[RequestView], float], observe: Callable[[RequestView, int], None]
                 | None = None, cost: CostFunction | None = None, weights: Weights | None = None,
                 counters: CounterStore | None = None):
        super().__init__(cost, weights, counters)
        self._predict, self._observe = predict, observe

    def _admit_charge(self, req: RequestView) -> None:
        pred = max(0.0, float(self._predict(req)))
        self._charged[req.request_id] = _Charged(req.client, req.prompt_tokens, pred)
        self._charge(req.client, self.cost.h(req.prompt_tokens, pred))

    def on_finish(self, req: RequestView, generated: int, now: float, prompt_tokens: int | None = None,
                  cached_tokens: int | None = None) -> None:
        self.on_tokens(req, generated, now)
        st = self._charged.pop(req.request_id, None)
        if st is not None and generated < st.n_q_charged:  # refund the over-prediction
            self._charge(st.client, self.cost.delta(st.n_p, st.n_q_charged, generated))
            st.n_q_charged = generated
        if st is not None:
            self._reconcile_prompt(st, prompt_tokens)
        if self._observe is not None and prompt_tokens != 0:
            self._observe(req, generated)
