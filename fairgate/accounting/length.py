"""Output-length prediction per (app, stage, prompt-length bucket), for reserving the KV a request will use
(Aladdin §2.3 and §4.3; docs/operations/configuration.md#reservation).

Aladdin predicts a request's output by the output lengths seen for prompts of about the same length ("the
estimated output length of each input length in the historical data"); fairgate keys that by app and stage too,
since one app's summaries and another's chat differ more than their prompts do. Each key keeps a histogram on
the log-spaced buckets of ``app_stats`` (4 per doubling, ≤ 19 % relative error), and every observation after the
first ``HALF_LIFE`` halves the older weight at that pace, so the distribution follows the traffic.

- ``upper(…, q)``: the q-quantile of the output length (the prediction *with* its interval: what a reservation
  holds);
- ``upper_beyond(…, l, q)``: the same, given the output already passed ``l`` tokens (Aladdin's re-prediction
  E[L | L > l] for an underestimate, at quantile q): what a stream that outlives its reservation grows to.

An output that reached its max_tokens was cut, not finished: its natural length was at least that (censored),
so it is counted as such (Kaplan-Meier over the buckets: ``_Hist``). Dropping cut outputs instead learns only
the lengths that fit under their caps, too short for an app whose clients cap them: its streams would outlive
their reservations and grow into a full backend. A quantile that falls beyond every natural length seen is
unknown (None: the caller reserves all a request may produce); one cut at 1 token says only that it was at
least 1 long, so a client asking for 1 token moves nothing.

A key with fewer than ``min_samples`` observations falls back to (app, stage) over all prompt lengths, then to
None (the caller reserves ``max_tokens``). Keys are bounded (least recently observed dropped). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from fairgate.accounting.app_stats import BUCKETS_PER_DOUBLING, bucket

HALF_LIFE = 500  # observations of a key after which an old one weighs half
ANY_PROMPT = -1  # the prompt bucket of a key's all-prompt-lengths histogram


def _top(b: int) -> float:
    """The largest length in histogram bucket b (a reservation covers its whole bucket)."""
    return 2.0 ** ((b + 1) / BUCKETS_PER_DOUBLING) - 1.0


def _low(b: int) -> float:
    """The smallest length in histogram bucket b (the top of the one below it)."""
    return _top(b - 1) if b > 0 else 0.0


def prompt_bucket(prompt_tokens: int) -> int:
    """Prompts within a factor of 2 share a bucket (Aladdin's prompt-length ranges; its edges are not given)."""
    return int(math.log2(max(1, prompt_tokens)))


class _Hist:
    """One key's lengths: ``hist`` the natural ones, ``cut`` those of outputs that reached their max_tokens (their
    natural length was at least that: censored). With none cut, the distribution is ``hist``'s; else the
    Kaplan-Meier estimate over the buckets (as a life table: an output cut within a bucket counts as running
    through half of it), whose mass beyond the longest natural length is the ``tail``: spread over the outputs
    cut there, each known only to have been at least as long."""

    __slots__ = ("w", "n", "hist", "cut", "mean", "_km")

    def __init__(self) -> None:
        self.w, self.n, self.hist, self.cut = 0.0, 0, {}, {}
        self.mean: float | None = None  # kept until the next observation (OutputLengths.mean)
        self._km: tuple[dict[int, float], dict[int, float]] | None = None  # (masses, tail), likewise

    def add(self, x: int, cut: bool = False) -> None:
        self.mean = self._km = None
        if self.n >= HALF_LIFE:  # decay by 2^(−1/HALF_LIFE) per observation, in one multiply per HALF_LIFE
            if self.n % HALF_LIFE == 0:
                self.w /= 2.0
                self.hist = {b: v / 2.0 for b, v in self.hist.items() if v > 1e-6}
                self.cut = {b: v / 2.0 for b, v in self.cut.items() if v > 1e-6}
        self.n += 1
        self.w += 1.0
        into = self.cut if cut else self.hist
        b = bucket(x)
        into[b] = into.get(b, 0.0) + 1.0

    def masses(self) -> tuple[dict[int, float], dict[int, float]]:
        """The natural lengths' weights per bucket and the tail's (per bucket of the outputs cut beyond the last
        natural length, in proportion to them), summing to ``w``: ``hist`` itself with none cut, else
        Kaplan-Meier's. O(buckets), once per observation."""
        if not self.cut:
            return self.hist, {}
        if self._km is None:
            at_risk = sum(self.hist.values()) + sum(self.cut.values())
            survive, masses, last = 1.0, {}, -1
            for b in sorted(self.hist.keys() | self.cut.keys()):
                ended, cut = self.hist.get(b, 0.0), self.cut.get(b, 0.0)
                exposed = at_risk - cut / 2  # (those cut within the bucket ran half of it: the life table's)
                if ended > 0 and exposed > 0:
                    after = survive * (1.0 - min(1.0, ended / exposed))
                    masses[b], survive, last = (survive - after) * self.w, after, b
                at_risk -= ended + cut
            beyond = {b: v for b, v in self.cut.items() if b >= last}
            total = sum(beyond.values())
            tail = {b: survive * self.w * v / total for b, v in beyond.items()} if survive > 0 and total > 0 else {}
            self._km = masses, tail
        return self._km

    def quantile_above(self, q: float, floor: int) -> float | None:
        """The q-quantile of the lengths above ``floor`` (all of them for floor < 0); None if none is, or if it
        lies in the tail beyond every natural length (all the caller can know is that it is long)."""
        masses, tail = self.masses()
        above = [(b, v) for b, v in sorted(masses.items()) if _top(b) > floor]
        tail_w = sum(tail.values())
        total = sum(v for _, v in above) + tail_w
        if total <= 0:
            return None
        acc = 0.0
        for b, v in above:
            acc += v
            if acc >= q * total:
                return _top(b)
        return None if tail_w > 0 else _top(above[-1][0])


class OutputLengths:
    def __init__(self, min_samples: int = 20, max_keys: int = 20_000):
        self.min_samples, self.max_keys = min_samples, max_keys
        self._keys: OrderedDict[tuple[str, int, int], _Hist] = OrderedDict()
        self.version = 0  # observations so far (a prediction made under one version stands until the next)

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, app: str, stage: int, prompt_tokens: int, output_tokens: int, cut: bool = False) -> None:
        """A finished request's output length (per choice); ``cut``: it reached its max_tokens, so its natural
        length was at least that."""
        if output_tokens < 1:
            return
        self.version += 1
        for pb in (prompt_bucket(prompt_tokens), ANY_PROMPT):
            key = (app, stage, pb)
            h = self._keys.get(key)
            if h is None:
                h = self._keys[key] = _Hist()
                if len(self._keys) > self.max_keys:
                    self._keys.popitem(last=False)
            else:
                self._keys.move_to_end(key)
            h.add(output_tokens, cut)

    def _hist(self, app: str, stage: int, prompt_tokens: int) -> _Hist | None:
        for pb in (prompt_bucket(prompt_tokens), ANY_PROMPT):
            h = self._keys.get((app, stage, pb))
            if h is not None and h.n >= self.min_samples:
                return h
        return None

    def mean(self, app: str, stage: int, prompt_tokens: int) -> float | None:
        """The conditional average output length (Aladdin's point prediction: unbiased, so errors cancel within a
        batch); None: not enough seen."""
        h = self._hist(app, stage, prompt_tokens)
        if h is None or h.w <= 0:
            return None
        if h.mean is None:  # (asked at every placement decision, changed only by an observation)
            masses, tail = h.masses()  # (the tail at the least it can be, its buckets' lower edges)
            h.mean = (sum(v * (2.0 ** ((b + 0.5) / BUCKETS_PER_DOUBLING) - 1.0) for b, v in masses.items())
                      + sum(v * _low(b) for b, v in tail.items())) / h.w
        return h.mean

    def predict(self, app: str, stage: int, prompt_tokens: int, cap: int | None, default: int) -> int:
        """A request's point prediction: the conditional mean, within its ``cap`` (its max_tokens, where the
        caller reads it); the cap, else ``default``, until enough are seen."""
        mean = self.mean(app, stage, prompt_tokens)
        if mean is None:
            return cap or default
        return max(1, round(mean) if cap is None else min(cap, round(mean)))

    def mean_beyond(self, app: str, stage: int, prompt_tokens: int, generated: int) -> float | None:
        """E[L | L > generated]: the conditional average output length of such a request that has already
        outlived ``generated`` tokens (Aladdin §4.3's re-prediction of an underestimate), from its prompt
        bucket's histogram, else (nothing that long there) its app and stage's; None: nothing that long seen.
        A histogram bucket counts for its part above ``generated`` (its lengths taken as spread evenly)."""
        for pb in (prompt_bucket(prompt_tokens), ANY_PROMPT):
            h = self._keys.get((app, stage, pb))
            if h is None or h.n < self.min_samples:
                continue
            total = acc = 0.0
            masses, tail = h.masses()
            for b, v in masses.items():
                low, top = _low(b), _top(b)
                if math.floor(top) <= generated:
                    continue
                part = v * min(1.0, (top - generated) / max(top - low, 1e-9))
                total += part
                acc += part * max(generated + 1.0, (max(low, generated) + top) / 2)
            for b, v in tail.items():  # (at least as long as it was cut: the larger of that and generated + 1)
                total += v
                acc += v * max(generated + 1.0, _low(b))
            if total > 0:
                return acc / total
        return None

    def upper(self, app: str, stage: int, prompt_tokens: int, q: float = 0.9) -> int | None:
        """The q-quantile of the output length of such a request (None: not enough seen)."""
        return self.upper_beyond(app, stage, prompt_tokens, -1, q)

    def upper_beyond(self, app: str, stage: int, prompt_tokens: int, generated: int, q: float = 0.9) -> int | None:
        """The q-quantile of its output length given it is already longer than ``generated`` (None: not enough
        seen, or nothing that long was)."""
        h = self._hist(app, stage, prompt_tokens)
        if h is None:
            return None
        value = h.quantile_above(q, generated)
        return None if value is None else max(generated + 1, math.floor(value))
