"""The engine's memory rule for a batch, summarised so that asking "would this request fit too?" costs
O(log batch) instead of a sort and a walk of the batch per candidate.

A batch of requests, each with ``used`` KV tokens of its own now and ``remaining`` output tokens to come, fits
if at its peak it needs no more than the cache holds. With the requests sorted by remaining tokens, longest
first (r_1 ≥ … ≥ r_n, u_i their used tokens, U_k = u_1 + … + u_k), the peak comes when the k-th request
finishes: need = max_k (r_k · k + U_k) (the request that finishes k-th from last still has r_k to grow, and the
k requests still running by then each grow by at most r_k while holding their own). A candidate (u, r) enters
after the p requests with r_i ≥ r: the terms before it are unchanged, its own is r · (p + 1) + U_p + u, and
each term after it gains one request and u tokens. So with the prefix maxima of r_k · k + U_k and the suffix
maxima of r_k · (k + 1) + U_k kept, a candidate's peak is three lookups after a bisection. Requests of equal
remaining length may stand in any order: a run of them peaks at its last, whose value does not depend on it.

Drift. Write the need as a peak over future times τ: need = max_τ Σ_{i: r_i ≥ τ} (u_i + τ). A decode step that
finishes nothing turns each decoding request's (u, r) into (u + 1, r − 1), so its term at τ becomes its old
term at τ + 1; the requests that do not decode (handed to the engine, not yet admitted, and the candidate)
keep theirs. At the old peak τ* ≥ 1, the new need at τ* − 1 is at least the old peak less 1 for each
non-decoding request alive at τ*; at τ* = 0 it is no less than before. So one such step lowers a candidate's
need by at most 1 + the handed requests (``DRIFT``), and a candidate short by more than that is still refused
after it (sim/gate.py keeps such refusals; tests/test_memory_rule.py checks the bound).

Shift. When every request of the batch decodes and none finishes, each (u, r) becomes (u + s, r − s) after s
steps: the batch's own terms r_k · k + U_k do not move, and a candidate (u, r) meets the terms it would meet in
the batch as summarised with (u − s, r + s) in its place (its position, its own term and the terms after it
alike). So a summary ``advance``s by s instead of being built again.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate

NEG = float("-inf")


class BatchMemory:
    """A batch's memory rule. The first question is answered by the walk itself (a batch asked once — the
    engine's own admissions, the gateway's head-of-line gate — pays no more than before); the summary is built
    at the second, and every question after costs a bisection."""

    def __init__(self, entries: Sequence[tuple[int, int]]):
        """``entries``: (used, remaining) of every request in the batch."""
        self._entries = entries
        self.n = len(entries)
        self._asked = 0
        self._summarised = False
        self.shift = 0  # decode steps the batch took since ``entries``, every request decoding, none finishing

    def advance(self, steps: int) -> None:
        """Every request decoded ``steps`` more tokens and none finished (the summary stands, shifted)."""
        self.shift += steps

    def drop_finished(self) -> None:
        """The requests that finished in the steps ``advance`` counted (their remaining tokens reached 0) leave:
        the last in a summary's order, which is cut there, its suffix maxima taken again. O(batch), no sort."""
        done = self.shift  # (before the shift, a finished request had exactly that many to go)
        self._entries[:] = [e for e in self._entries if e[1] != done]
        self.n = len(self._entries)
        if not self._summarised:
            return
        n = self.n
        del self._neg_remaining[n:], self._used[n + 1:], self._before[n + 1:]
        self._take_after()

    def add(self, used: int, remaining: int) -> None:
        """One more request (``used``, ``remaining``) in the batch: put where a summary would sort it, the sums and
        maxima after it (and the suffix maxima before it) taken again. O(batch), no sort."""
        used, remaining = used - self.shift, remaining + self.shift  # (as the others, before the shift)
        self._entries.append((used, remaining))
        self.n += 1
        if not self._summarised:
            return
        p = bisect.bisect_right(self._neg_remaining, -remaining)  # after those with r_i ≥ remaining
        self._neg_remaining.insert(p, -remaining)
        sums = self._used
        sums[p + 1:] = [sums[p] + used, *(x + used for x in sums[p + 1:])]
        del self._before[p + 1:]
        self._extend_before()
        self._take_after()

    def need(self) -> int:
        """The batch's peak KV tokens (its own, beyond the shared prompt blocks)."""
        return _walk(self._entries)

    def need_with(self, used: int, remaining: int) -> int:
        """The peak with one more request (``used``, ``remaining``)."""
        used, remaining = used - self.shift, remaining + self.shift
        if not self._summarised:
            self._asked += 1
            if self._asked == 1:  # the first question: walk
                return _walk([*self._entries, (used, remaining)])
            self._summarise()
        p = bisect.bisect_right(self._neg_remaining, -remaining)  # requests with r_i ≥ remaining
        return max(self._before[p], remaining * (p + 1) + self._used[p] + used, self._after[p] + used)

    def _summarise(self) -> None:
        ordered = sorted(self._entries, key=lambda e: e[1], reverse=True)
        self._neg_remaining = [-r for _, r in ordered]  # ascending, for bisect
        self._used = list(accumulate((u for u, _ in ordered), initial=0))  # U_0 … U_n
        self._before = [0]  # max over k ≤ i of r_k · k + U_k (0 for none)
        self._extend_before()
        self._take_after()
        self._summarised = True

    def _extend_before(self) -> None:
        """The prefix maxima past those kept, up to position n."""
        before, start = self._before, len(self._before)
        terms = [u - nr * k for k, nr, u in zip(range(start, self.n + 1), self._neg_remaining[start - 1:],
                                                 self._used[start:])]
        before += list(accumulate(terms, max, initial=before[-1]))[1:]

    def _take_after(self) -> None:
        """The suffix maxima: max over k > i of r_k · (k + 1) + U_k, at index i (−inf past the last)."""
        terms = [u - nr * k for k, nr, u in zip(range(2, self.n + 2), self._neg_remaining, self._used[1:])]
        after = self._after = list(accumulate(reversed(terms), max, initial=NEG))
        after.reverse()


def _walk(entries: Sequence[tuple[int, int]]) -> int:
    """The rule as stated: sorted by remaining tokens, longest first, the peak of r_k · k + U_k."""
    need = used = 0
    for k, (u, r) in enumerate(sorted(entries, key=lambda e: e[1], reverse=True), start=1):
        used += u
        if r * k + used > need:
            need = r * k + used
    return need
