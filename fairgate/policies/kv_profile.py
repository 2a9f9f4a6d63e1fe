"""A set of running requests' future KV, as Aladdin's constraint (e) sees it (§3.2; policies/aladdin.py, and the
gate's ``kv_gate: future``, proxy/pipeline/kv_gate.py): each request holds kv(start + k) in each of its next
iterations k = 0 … end (h = 1 token, j = 0: Eq. 1), so the set's KV rises between completions and peaks at one
of them. Pure; numpy for the running minima."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

_NONE = np.zeros(0, dtype=np.int64)


class KVProfile:
    """A backend's future-KV profile at one instant (constraint (e)): its requests as (end, start) — the
    iterations left and the KV they hold now — sorted by end, latest first, with for each position k the margin
    M − Σ_{i≤k} start_i − (k+1)·end_k (the KV left at iteration end_k), its running minimum from the front and
    the minimum of margin_k − end_k from the back. A new request (E, S) fits iff the positions ending later keep
    margin ≥ 0, those ending no later keep margin − end ≥ S, and its own iteration E fits. The sums and minima
    are derived when a check needs them: requests that come and go between two checks cost one derivation."""

    __slots__ = ("neg_ends", "ends", "starts", "start_sums", "front_min", "back_min", "capacity", "_derived")

    def __init__(self, items: list[tuple[int, int]], capacity: int | None):
        items.sort(reverse=True)
        self.capacity = capacity
        self.ends = [e for e, _ in items]
        self.starts = [s for _, s in items]
        self.neg_ends = [-e for e in self.ends]
        self._derived = False

    def _derive(self) -> None:
        self._derived = True
        if not self.ends:  # (no request: nothing to derive; the usual case for answers fetched whole)
            self.start_sums = self.front_min = self.back_min = _NONE
            return
        ends, starts = np.array(self.ends, dtype=np.int64), np.array(self.starts, dtype=np.int64)
        self.start_sums = np.cumsum(starts)
        if self.capacity is None or not self.ends:
            return
        margins = self.capacity - self.start_sums - np.arange(1, len(ends) + 1) * ends
        self.front_min = np.minimum.accumulate(margins)
        self.back_min = np.minimum.accumulate((margins - ends)[::-1])[::-1]

    def set_capacity(self, capacity: int | None) -> None:
        """The same requests against another capacity (derived again at the next check: O(n), no sort)."""
        if capacity != self.capacity:
            self.capacity = capacity
            self._derived = False

    def fits(self, end: int, start: int) -> bool:
        if self.capacity is None:
            return True
        if not self._derived:
            self._derive()
        i = bisect_left(self.neg_ends, -end)  # the first position ending no later than the new request
        if i and self.front_min[i - 1] < 0:
            return False
        if i < len(self.ends) and self.back_min[i] < start:
            return False
        return int(self.start_sums[i - 1] if i else 0) + start + (i + 1) * end <= self.capacity

    def add(self, end: int, start: int, copies: int = 1) -> None:
        """``copies`` requests of (end, start) join: an O(n) insertion, no sort."""
        i = bisect_left(self.neg_ends, -end)
        self.ends[i:i] = [end] * copies
        self.starts[i:i] = [start] * copies
        self.neg_ends[i:i] = [-end] * copies
        self._derived = False

    def remove(self, end: int, start: int, copies: int = 1) -> None:
        for _ in range(copies):
            i = bisect_left(self.neg_ends, -end)
            while i < len(self.ends) and self.ends[i] == end and self.starts[i] != start:
                i += 1
            if i < len(self.ends) and (self.ends[i], self.starts[i]) == (end, start):
                del self.ends[i], self.starts[i], self.neg_ends[i]
        self._derived = False

    def peak(self) -> int:
        """The most KV the set holds in any future iteration (0 if empty)."""
        if not self.ends:
            return 0
        if not self._derived:
            self._derive()
        return int((self.start_sums + np.arange(1, len(self.ends) + 1) * np.array(self.ends, dtype=np.int64)).max())


def future_kv_fits(batch: list[tuple[int, int, int]], capacity: int) -> bool:
    """(e) for a whole batch of (l_in, gen, total): Σ over the requests still running at iteration k of
    kv(l_in + gen + k) ≤ capacity for every k ≥ 0. A request runs iterations k = 0 … total − gen, holding
    kv(l_in + gen + k) in each: w_j = [kv(l_in), …, kv(l_in + l_pred)] for a new one (the paper's vector of §3)."""
    *rest, (l_in, gen, total) = batch
    return KVProfile([(t - g, i + g) for i, g, t in rest], capacity).fits(total - gen, l_in + gen)
