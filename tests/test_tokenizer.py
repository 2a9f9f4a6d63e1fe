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


def test_what_a_template_renders_is_counted_whatever_its_nesting():
    """Tools, tool calls, documents and media count toward the prompt; a value nested past orjson's 254 levels
    (a client may send 1,000) or holding an integer past 64 bits is counted by its text, never an error."""
    import orjson

    from fairgate.accounting.tokenizer import Tokenizer

    t = Tokenizer(media_tokens=1000)
    hi = [{"role": "user", "content": "hi"}]
    bare = t.count_chat(hi).prompt_tokens
    tool = {"type": "function", "function": {"name": "lookup", "description": "finds a thing " * 50}}
    assert t.count_chat(hi, None, {"tools": [tool]}).prompt_tokens > bare + 100
    image = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert t.count_chat(image).prompt_tokens == bare + 1000
    deep = orjson.loads(b"[" * 1020 + b'{"a": 1}' + b"]" * 1020)
    assert t.count_chat(hi, None, {"tools": deep}).prompt_tokens > bare + 1000
    assert t.count_chat(hi, None, {"documents": [{"n": 2**70}]}).prompt_tokens > bare
