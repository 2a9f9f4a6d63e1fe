"""Prompt counts stay exact while a caller's recent texts are tokenized once: a conversation's history, sent
again each turn, costs only its new message; callers never share entries; the memory is bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.accounting.tokenizer import RecentCounts, Tokenizer

TOK = Tokenizer()


def test_a_conversation_tokenizes_only_its_new_message(monkeypatch):
    tok = Tokenizer()
    counted: list[str] = []
    original = tok.count
    monkeypatch.setattr(tok, "count", lambda text: counted.append(text) or original(text))
    history = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    first = tok.count_chat(history, ("app", "alice"))
    history += [{"role": "assistant", "content": "Seven."}, {"role": "user", "content": "Another one?"}]
    counted.clear()
    second = tok.count_chat(history, ("app", "alice"))
    assert sorted(counted) == ["Another one?", "Seven.", "assistant"]  # (a role is counted once, ever)
    assert second == TOK.count_chat(history) and first == TOK.count_chat(history[:2])
    counted.clear()
    tok.count_chat(history, ("app", "bob"))  # another caller: its own entries, nothing learnt from alice's
    assert len(counted) == 4  # its four texts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.text(max_size=40)), max_size=40),
       st.integers(1, 3000))
def test_counts_stay_exact_and_the_memory_bounded(sends, budget):
    tok = Tokenizer()
    tok.recent = RecentCounts(budget=budget, max_text=60)
    for scope, text in sends:
        messages = [{"role": "user", "content": text}]
        assert tok.count_chat(messages, scope) == TOK.count_chat(messages)
        kept = tok.recent._counts
        assert tok.recent.used == sum(len(t) + RecentCounts.ENTRY_COST for _, t in kept) <= budget
        assert all(n == TOK.count(t) for (_, t), n in kept.items())
