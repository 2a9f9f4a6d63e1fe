"""The simulator's summarised memory rule (engine/memory_rule.py) answers exactly what sorting the batch and
walking it does, for any batch and candidate."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.engine.memory_rule import BatchMemory

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


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(2, 2000)), max_size=40),
       st.lists(entry, max_size=4), entry, st.integers(1, 30))
def test_a_decode_step_lowers_a_candidates_need_by_at_most_the_drift(decoding, handed, candidate, steps):
    """The bound sim/gate.py keeps refusals by: a decode step that finishes nothing (every decoding request
    has r ≥ 2 before it) lowers the need of the batch plus a candidate by at most 1 + the handed requests
    (which do not decode); so after ``steps`` such steps a candidate refused by more than that drift is
    still refused. Tight: a candidate that outlives a decoding request loses exactly 1 a step."""
    before = BatchMemory(decoding + handed).need_with(*candidate)
    for _ in range(steps):
        if any(r < 2 for _, r in decoding):
            break  # the next step finishes a request: the gate starts afresh then
        decoding = [(u + 1, r - 1) for u, r in decoding]
        after = BatchMemory(decoding + handed).need_with(*candidate)
        assert after >= before - (1 + len(handed))
        before = after


def test_the_drift_bound_is_reached():
    # a request decoding (0 used, 10 to go) beside a candidate (10 used, 10 to go): both end together, at a
    # peak of 2·10 + 10 = 30; one step later the running one ends a step before it (9·2 + 11 = 29)
    assert BatchMemory([(0, 10)]).need_with(10, 10) - BatchMemory([(1, 9)]).need_with(10, 10) == 1


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 2000)), max_size=40),
       st.lists(entry, min_size=1, max_size=4), st.lists(st.integers(1, 50), min_size=1, max_size=3))
def test_a_summary_advanced_by_decode_steps_answers_as_one_built_after_them(batch, candidates, advances):
    """Steps in which every request decodes and none finishes: the summary built before them, ``advance``d
    (what sim/gate.py keeps), answers every candidate as a summary of the batch after them does (and as the
    walk does), whether it had walked or summarised when it advanced."""
    memory, steps = BatchMemory(batch), 0
    for s in advances:
        if any(r <= steps + s for _, r in batch):
            break  # a request would finish: the gate builds the summary afresh
        steps += s
        memory.advance(s)
        now = [(u + steps, r - steps) for u, r in batch]
        assert memory.need() == walked(now)
        for candidate in candidates:
            assert memory.need_with(*candidate) == walked(now + [candidate])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 2000)), max_size=40), st.integers(0, 3),
       st.integers(0, 30), st.lists(entry, max_size=4), st.lists(entry, min_size=1, max_size=4))
def test_a_request_added_to_a_summary_answers_as_a_summary_built_with_it(batch, asked, steps, added, candidates):
    """Requests handed to an engine join its summary (``add``) — built or not yet, advanced or not — and every
    candidate then meets what the walk of the whole batch says."""
    memory = BatchMemory(list(batch))  # (its entries list is its own: it appends to it)
    for candidate in candidates[:asked]:  # (none: the walk's mode; one: still the walk; two: summarised)
        memory.need_with(*candidate)
    if steps and all(r > steps for _, r in batch):
        memory.advance(steps)
        batch = [(u + steps, r - steps) for u, r in batch]
    for entry_ in added:
        memory.add(*entry_)
        batch = batch + [entry_]
        assert memory.need() == walked(batch)
        for candidate in candidates:
            assert memory.need_with(*candidate) == walked(batch + [candidate])


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 60)), min_size=1, max_size=40), st.integers(0, 3),
       st.lists(entry, min_size=1, max_size=4))
def test_a_summary_advanced_to_a_finish_drops_what_finished(batch, asked, candidates):
    """Decode steps up to the first finish (as the engine runs them): the summary advanced by them, the finished
    requests dropped, answers as the walk of the survivors."""
    memory = BatchMemory(list(batch))
    for candidate in candidates[:asked]:
        memory.need_with(*candidate)
    steps = min(r for _, r in batch)
    memory.advance(steps)
    memory.drop_finished()
    survivors = [(u + steps, r - steps) for u, r in batch if r > steps]
    assert memory.n == len(survivors) and memory.need() == walked(survivors)
    for candidate in candidates:
        assert memory.need_with(*candidate) == walked(survivors + [candidate])
