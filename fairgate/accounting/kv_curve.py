"""KV as a function of the future decode step, shared across replicas (storage/sync_lua.py).

A replica's requests on a backend hold, at each future decode step e, their prompts and what they have generated,
one token more each step, until each ends (policies/kv_profile.py). Two replicas whose requests peak at
different steps can share a backend that neither could share if each claimed its own peak at every step. So
what a replica publishes, and the budget it gets back, is a *curve*: a line in each cell of a fixed grid of
steps (one step wide up to 16, then 8 cells an octave), an upper bound of its requests' KV there for what it
publishes, and for its budget the KV it may hold at each step. The budgets of the replicas on a backend add up
to at most the backend's KV at every step.

A curve is ``v`` (the value at each cell's first step) and ``s`` (its slope in the cell); cells past the last
encoded one continue its line. The gate (pipeline/kv_gate.py) checks a newcomer against its budget with a
``Margin``: the budget, aged by the decode steps taken since it was given, less this replica's requests, at
every step where either bends. Pure.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from msgspec import msgpack


def _grid(unit: int = 16, per_octave: int = 8) -> np.ndarray:
    """Cell starts: one step wide up to ``unit``, then ``per_octave`` cells an octave (finer cells cost the sync
    script more and filled the two-replica test's backends no better: 0.79-0.80 at 64 and 32 an octave alike)."""
    starts, x = list(range(unit)), unit
    while x < 1 << 17:  # (past any context a backend serves)
        width = x // per_octave
        for _ in range(per_octave):
            starts.append(x)
            x += width
    return np.array(starts, dtype=np.float64)


GRID = _grid()
_STARTS = GRID.tolist()  # (the same, for the checks' plain-float path)


@dataclass(frozen=True)
class Curve:
    """A piecewise-linear function of the future step on GRID: ``v[k] + s[k]·(e − GRID[k])`` in cell k (the
    last of the ``n`` cells given goes on for ever)."""

    v: np.ndarray
    s: np.ndarray

    @classmethod
    def flat(cls, value: float) -> Curve:
        return cls(np.array([float(value)]), np.zeros(1))

    def at(self, x):
        """The curve at step(s) ``x`` ≥ 0 (a float or an array)."""
        k = np.minimum(np.searchsorted(GRID, x, side="right") - 1, len(self.v) - 1)
        return self.v[k] + self.s[k] * (x - GRID[k])

    @property
    def tail_slope(self) -> float:
        return float(self.s[-1])

    def packed(self) -> bytes:
        """msgpack [v, s, v, s, …] in whole tokens (rounded up: it bounds requests from above), up to the last
        cell that does not continue the line before it (the sync script's format)."""
        v, s = np.ceil(self.v - 1e-9), np.ceil(self.s - 1e-9)
        n = len(v)
        while n > 1 and s[n - 1] == s[n - 2] and v[n - 1] == v[n - 2] + s[n - 2] * (GRID[n - 1] - GRID[n - 2]):
            n -= 1
        flat = np.empty(2 * n, dtype=np.int64)
        flat[0::2], flat[1::2] = v[:n], s[:n]
        return msgpack.encode(flat.tolist())

    @classmethod
    def unpacked(cls, values: list[int]) -> Curve:
        """A curve from [v, s, v, s, …] (as the sync script returns a budget)."""
        if len(values) < 2:
            return cls.flat(0.0)
        array = np.asarray(values, dtype=np.float64)
        return cls(array[0::2].copy(), array[1::2].copy())

    @property
    def peak(self) -> float:
        """The most the curve reaches at any step (inf if it grows for ever)."""
        if self.s[-1] > 0:
            return math.inf
        n = len(self.v)
        ends = self.v[:-1] + self.s[:-1] * (GRID[1:n] - GRID[: n - 1])
        return float(max(self.v.max(), ends.max() if n > 1 else -math.inf))


class Budget(NamedTuple):
    """A replica's KV budget on a backend: the curve, the loop time it stands at, and the rate of the backend's
    step clock it ages at (storage/sync_lua.py) — or what it holds itself to, in the same form."""

    curve: Curve
    at: float
    rate: float

    def aged(self, now: float) -> float:
        """The steps the backend's clock counts from ``at`` to ``now``."""
        return self.rate * max(0.0, now - self.at)


def upper(ends: np.ndarray, start_sums: np.ndarray, fixed: float) -> Curve:
    """An upper bound of a profile's KV at each step (its requests as KVProfile holds them: ``ends`` latest
    first, ``start_sums`` the running sums of their starts) plus a ``fixed`` load: exact at each cell's first
    step, and in the cell growing by one per request then running (a request ending in the cell is counted to its
    end)."""
    last = int(ends[0]) if len(ends) else -1
    n = int(np.searchsorted(GRID, last, side="right")) + 1  # (then none runs: the line is flat)
    n = min(max(n, 1), len(GRID))
    g = GRID[:n]
    running = np.searchsorted(-np.asarray(ends, dtype=np.float64), -g, side="right")  # requests with end ≥ g
    sums = np.where(running > 0, np.asarray(start_sums, dtype=np.float64)[np.maximum(running - 1, 0)], 0.0) \
        if len(ends) else np.zeros(n)
    return Curve(fixed + sums + running * g, running.astype(np.float64))


class Margin:
    """What a budget leaves beside this replica's requests at each future step: m(e) = min(the least the budget
    is within ``slack`` steps of e + aged, capacity) − own(e) (the others' count of its age may be off that
    much), where own(e) = fixed + Σ over requests with end ≥ e of (start + e). m is linear between the steps
    where a request ends (and the one after) or the budget's cells begin, so checking those suffices: a newcomer
    (E, S) fits iff m(e) − e ≥ S at every e ≤ E and m(e) ≥ 0 at every e > E. Built in O((n + cells) log);
    a check is O(log)."""

    def __init__(self, ends: list[int], start_sums: np.ndarray, fixed: float, budget: Curve, aged: float,
                 capacity: float = math.inf, slack: float = 0.0):
        self.budget, self.aged, self.fixed, self.capacity, self.slack = budget, aged, fixed, capacity, slack
        self.shifts = np.array([-slack, slack] if slack else [0.0])
        self.ends_up = np.sort(np.asarray(ends, dtype=np.float64))  # ascending
        self.sums = np.asarray(start_sums, dtype=np.float64)  # over ends latest first
        cells = (GRID[1:len(budget.v)][None, :] - aged - self.shifts[:, None]).ravel()
        cells = cells[cells > 0]
        bends = np.concatenate(([0.0], self.ends_up, self.ends_up + 1, np.ceil(cells) - 1, np.ceil(cells)))
        self.x = np.unique(bends[bends >= 0])
        self.m = self._margin(self.x)
        self.before = np.minimum.accumulate(self.m - self.x)  # min of m(e) − e over points up to each
        self.after = np.minimum.accumulate(self.m[::-1])[::-1]  # min of m over points from each on
        self.tail_ok = budget.tail_slope >= 0  # (past every point only the budget moves)
        self._lists: tuple[list[float], ...] | None = None
        self._points: tuple[list[float], ...] | None = None

    def own(self, e):
        running = len(self.ends_up) - np.searchsorted(self.ends_up, e, side="left")  # end ≥ e
        sums = np.where(running > 0, self.sums[np.maximum(running - 1, 0)], 0.0) if len(self.sums) else 0.0
        return self.fixed + sums + running * e

    def room(self, x):
        """The least the budget is within ``slack`` steps of step(s) ``x`` (the ends, and both sides of every
        cell that begins between them: a budget only jumps where a cell begins), within the capacity."""
        budget, x = self.budget, np.asarray(x, dtype=np.float64)
        lo, hi = np.maximum(x - self.slack, 0.0), x + self.slack
        room = np.minimum(budget.at(lo), budget.at(hi))
        first, n = np.searchsorted(GRID, lo, side="right"), len(budget.v)
        for j in range(int(math.ceil(2 * self.slack)) + 1 if self.slack else 0):  # (cells are a step wide at least)
            k = first + j
            inside = (k < n) & (GRID[np.minimum(k, len(GRID) - 1)] <= hi)
            k = np.where(inside, k, 1)
            left = budget.v[k - 1] + budget.s[k - 1] * (GRID[k] - GRID[k - 1])  # (as the cell before ends)
            room = np.where(inside, np.minimum(room, np.minimum(budget.v[np.minimum(k, n - 1)], left)), room)
        return np.minimum(room, self.capacity)

    def _margin(self, e):
        return self.room(np.asarray(e, dtype=np.float64) + self.aged) - self.own(e)

    def fits(self, end: int, start: int, copies: int = 1) -> bool:
        if not self.tail_ok:
            return False
        if copies != 1:  # (rare: a request of several choices; O(points))
            inside = self.x <= end
            grow = copies * (start + self.x)
            e = np.array([float(end), float(end + 1)])
            return bool(np.all(self.m[inside] >= grow[inside]) and np.all(self.m[~inside & (self.x > end)] >= 0)
                        and self._margin(e[0]) >= copies * (start + end) and self._margin(e[1]) >= 0)
        if self._points is None:
            self._points = (self.x.tolist(), self.before.tolist(), self.after.tolist())
        x, before, after = self._points
        i = bisect_right(x, end)
        if i and before[i - 1] < start:
            return False
        if self._at(float(end)) - end < start or self._at(float(end + 1)) < 0:
            return False
        j = bisect_right(x, end + 1)
        return j >= len(x) or after[j] >= 0

    def _at(self, e: float) -> float:
        """m(e) at one step, in plain floats (``_margin`` for one step, at a tenth of its cost)."""
        if self._lists is None:
            self._lists = (self.budget.v.tolist(), self.budget.s.tolist(), self.ends_up.tolist(), self.sums.tolist())
        v, s, ends, sums = self._lists
        n, x, d = len(v), e + self.aged, self.slack

        def at(y: float) -> float:
            k = min(bisect_right(_STARTS, y) - 1, n - 1)
            return v[k] + s[k] * (y - _STARTS[k])

        lo, hi = max(x - d, 0.0), x + d
        room = min(at(lo), at(hi), self.capacity)
        k = bisect_right(_STARTS, lo)
        while d and k < n and _STARTS[k] <= hi:  # (both sides of each cell that begins within the window)
            room = min(room, v[k], v[k - 1] + s[k - 1] * (_STARTS[k] - _STARTS[k - 1]))
            k += 1
        running = len(ends) - bisect_left(ends, e)
        return room - (self.fixed + (sums[running - 1] if running else 0.0) + running * e)

    def free(self) -> float:
        """The KV free at every future step (what a request that ends at once could take)."""
        return max(0.0, float(self.m.min())) if self.tail_ok else 0.0
