"""Power of two choices (the baseline of Aladdin's Fig. 12, check A7): two backends drawn at random, the
request goes to the one with less predicted work. Pure: its random draws come from its own seeded generator.

The load metric (AMBIG-8, docs/policies/aladdin.md#open-choices) is what Aladdin's ledger would hold, without its constraints: the prompt
plus the *predicted* output (the conditional mean of accounting/length.py, learnt from finished requests;
``max_tokens`` until enough are seen, where it reads it) of every request placed there and not yet finished.
O(1) a decision.
"""

from __future__ import annotations

import random
from typing import Sequence

from fairgate.accounting.length import OutputLengths
from fairgate.policies.placement import Placement
from fairgate.policies.views import BackendView, RequestView


class PowerOfTwo(Placement):
    name = "power-of-two"

    def __init__(self, *, seed: int = 0, default_output: int = 256, lengths: OutputLengths | None = None,
                 read_max_tokens: bool = True):
        self._rng = random.Random(seed)
        self.default_output, self.read_max_tokens = default_output, read_max_tokens
        self.lengths = lengths if lengths is not None else OutputLengths()
        self._learns = lengths is None  # lengths given are fed by their owner
        self._load: dict[str, int] = {}  # backend → Σ (l_in + l_pred) of what it holds
        self._placed: dict[str, tuple[str, int]] = {}  # request → (backend, its l_in + l_pred)

    def predicted(self, request: RequestView) -> int:
        cap = request.max_tokens if self.read_max_tokens and request.max_tokens else None
        return self.lengths.predict(request.app, request.stage, request.prompt_tokens, cap, self.default_output)

    def choose(self, request: RequestView, backends: Sequence[BackendView], now: float) -> BackendView | None:
        if not backends:
            return None
        pair = [backends[i] for i in self._rng.sample(range(len(backends)), 2)] if len(backends) > 1 \
            else [backends[0]]
        best = min(pair, key=lambda b: self._load.get(b.name, 0))  # (a tie: the first drawn)
        self._forget(request.request_id)
        work = request.prompt_tokens + self.predicted(request)
        self._placed[request.request_id] = (best.name, work)
        self._load[best.name] = self._load.get(best.name, 0) + work
        return best

    def _forget(self, rid: str) -> None:
        placed = self._placed.pop(rid, None)
        if placed is not None:
            backend, work = placed
            left = self._load[backend] - work
            if left:
                self._load[backend] = left
            else:
                del self._load[backend]

    def on_finish(self, request: RequestView, backend: str, generated: int) -> None:
        self._forget(request.request_id)
        if self._learns:
            self.lengths.observe(request.app, request.stage, request.prompt_tokens, generated)

    def refund(self, request: RequestView, backend: str) -> None:
        self._forget(request.request_id)
