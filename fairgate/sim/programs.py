"""Prompts with content, for locality (docs/simulator/index.md#programs): shared prefixes, multi-turn
conversations and tree-of-thought programs, described by segments so the prefix cache sees real reuse.

A prompt is a list of ``(segment_id, length)`` runs (``accounting/prefix.segment_hashes``): a shared prefix is
one segment every request of its group starts with, a request's own input and each output are fresh
segments. Workload keys (docs/simulator/index.md#programs):

- ``prefix: {tokens, pool, group}``: every request starts with one of ``pool`` prefixes of ``tokens`` tokens
  (a uniform draw); clients naming the same ``group`` share those prefixes, otherwise they are the client's own;
- ``conversation: {turns, think_s}``: each arrival starts a conversation; each next call's prompt is the
  previous prompt + its output + new ``input_tokens``, sent ``think_s`` after the answer;
- ``tree: {branches, depth, turn_tokens}``: a tree-of-thought program (SGLang's tree_of_thought_deep): level j
  (from 0) has branches^(j+1) calls; a call's prompt is its parent's prompt + the parent's output + a new
  instruction of ``turn_tokens``; each call is sent when its own parent finishes (as SGLang's forks run), so
  a child follows its parent while the parent's KV is fresh.

The second and later calls of a program are the simulator's interaction stages, released as the stage before
them finishes (a tree's calls: as their parent finishes).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Any, Callable

from fairgate.accounting.prefix import segment_hashes

BLOCK_SIZE = 16  # the engine profiles' KV block size

Segments = list[tuple[int, int]]


class Content:
    """Fresh segment ids, and the ids of shared prefixes by (group, index)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._shared: dict[tuple[str, int], int] = {}

    def fresh(self) -> int:
        return next(self._ids)

    def shared(self, group: str, k: int) -> int:
        key = (group, k)
        if key not in self._shared:
            self._shared[key] = self.fresh()
        return self._shared[key]


def has_program(c: dict[str, Any]) -> bool:
    return any(k in c for k in ("prefix", "conversation", "tree", "judge"))


def client_programs(c: dict[str, Any], times: list[float], rng: random.Random, content: Content,
                    length: Callable[[Any, random.Random], int], make) -> None:
    """Calls of a client with prefixes, conversations, trees or judge programs. ``make(t, prompt_segments, output, stage,
    interaction, final, parent=None)`` appends one call (sent when ``parent`` finishes) and returns it."""
    cid = str(c["id"])
    pre = c.get("prefix")
    conv, tree, judge = c.get("conversation"), c.get("tree"), c.get("judge")
    for k, t in enumerate(times):
        segs: Segments = []
        if pre:
            group = str(pre.get("group", cid))
            segs.append((content.shared(group, rng.randrange(int(pre.get("pool", 1)))), int(pre["tokens"])))
        segs.append((content.fresh(), length(c.get("input_tokens", 256), rng)))
        x = f"{cid}#{k}"
        if conv:
            turns = max(1, int(conv.get("turns", 1)))
            for j in range(turns):
                call = make(t if j == 0 else math.inf, segs, length(c.get("output_tokens", 256), rng), j,
                            x if turns > 1 else "", j == turns - 1)
                segs = segs + [call.output_segment, (content.fresh(), length(c.get("input_tokens", 256), rng))]
        elif tree:  # the question is the root; level j has branches^(j+1) calls; each adds a turn of its own
            b, depth = max(1, int(tree.get("branches", 2))), max(1, int(tree.get("depth", 4)))
            turn = tree.get("turn_tokens", c.get("input_tokens", 256))  # the next step's instruction
            parents = [(segs, None)]
            for j in range(depth):
                children = []
                for p, parent in parents:
                    for _ in range(b):
                        call = make(t if j == 0 else math.inf, p, length(c.get("output_tokens", 256), rng), j,
                                    x, j == depth - 1, parent)
                        children.append((p + [call.output_segment, (content.fresh(), length(turn, rng))], call))
                parents = children
        elif judge:  # LLM-as-a-judge (branch-solve-merge): k judgements of the article, then one merge of them
            k = max(1, int(judge.get("dimensions", 2)))
            judged = [make(t, segs + [(content.fresh(), length(judge.get("instruction_tokens", 32), rng))],
                           length(c.get("output_tokens", 256), rng), 0, x, False).output_segment for _ in range(k)]
            make(math.inf, segs + judged + [(content.fresh(), length(judge.get("instruction_tokens", 32), rng))],
                 length(judge.get("merge_output", 2), rng), 1, x, True)
        else:
            make(t, segs, length(c.get("output_tokens", 256), rng), 0, "", True)


def hashes(segments: Segments, salt: str | None = None) -> list[int]:
    return segment_hashes(segments, BLOCK_SIZE, salt)
