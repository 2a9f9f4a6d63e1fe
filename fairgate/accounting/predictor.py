"""Output-length prediction per client (VTC §4.4, App. B.3)."""

from __future__ import annotations


class EMAPredictor:
    """The artifact's VTC(predict) predictor: 0 until a client's first completion, then
    pred ← (4·pred + actual) / 5 — an exponential moving average with α = 1/5
    (docs/policies/vtc.md#artifact-predict)."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self._pred: dict[str, float] = {}

    def predict(self, client: str) -> float:
        return self._pred.get(client, 0.0)

    def observe(self, client: str, actual: int) -> None:
        old = self._pred.get(client, 0.0)
        self._pred[client] = float(actual) if old == 0 else (1 - self.alpha) * old + self.alpha * actual
