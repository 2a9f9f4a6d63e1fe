"""The simulator's summarised memory rule (sim/memory_rule.py) answers exactly what sorting the batch and
walking it does, for any batch and candidate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.sim.memory_rule import BatchMemory

entry = st.tuples(st.integers(0, 5000), st.integers(0, 2000))


def walked(entries: list[tuple[int, int]]) -> int:
    """The rule as written: sorted by remaining tokens, longest first, the peak of r_k · k + U_k."""
    need, used = 0, 0
    for k, (u, r) in enumerate(sorted(entries, key=lambda e: e[1], reverse=True), start=1):
        used += u
        need = max(need, r * k + used)
    return need


@settings(max_examples=500, deadline=None)
@given(st.lists(entry, max_size=40), st.lists(entry, min_size=1, max_size=4))
def test_a_candidate_peaks_as_the_walk_says(batch, candidates):
    memory = BatchMemory(batch)
    assert memory.need() == walked(batch)
    for candidate in candidates:  # the first answered by the walk, the others by the summary
        assert memory.need_with(*candidate) == walked(batch + [candidate])
