"""The engine model with vLLM v1's KV admission: admit on what a request holds now, preempt when a step lacks room.

``Engine`` (engine/batching.py) reserves every running request's whole future, so it never preempts. That is the
simulator's model and a safe emulator, but it is not what vLLM does, and it caps how full a gateway can keep a
backend (0.79-0.81 of its KV on the two-replica flood of tests/test_replicas.py, with requests always waiting
there). vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py) instead:

- admits a waiting request, first come first served, when the KV for its prompt (and first token) is free now;
- before a step, finds each running request a slot for its next token; when there is none, it preempts the
  running request of lowest priority (under FCFS the last admitted), frees all its KV and puts it back at the
  head of the waiting queue: it is recomputed later (its prompt and what it generated are prefilled again) and
  its stream goes on where it stopped.

So how full such a backend runs, and whether it preempts, is the gateway's doing alone: ``preemptions_total``
(``vllm:num_preemptions`` on the emulator's /metrics) counts each. Memory is counted in tokens, as ``Engine``
counts it (whole prompt blocks shared, each request's tail in tokens); the emulator serves this engine with
``admission: vllm`` (``fairgate backend-sim --admission vllm``, ``emulated.admission``).
"""

from __future__ import annotations

from fairgate.engine.batching import NO_SEAT, Engine, EngineRequest, FifoQueue, Step
from fairgate.engine.memory_rule import BatchMemory
from fairgate.engine.profiles import EngineProfile

ADMISSIONS = ("future", "vllm")  # Engine's (every future reserved) and this one's


class PreemptingEngine(Engine):
    def __init__(self, profile: EngineProfile, *, admit_every: int = 1, prefix_caching: bool = True,
                 max_batch_prompt_tokens: int | None = None):
        super().__init__(profile, admit_every=admit_every, prefix_caching=prefix_caching,
                         max_batch_prompt_tokens=max_batch_prompt_tokens, queue=FifoQueue())

    def room(self, entries: list[tuple[int, int]] | BatchMemory, clients: set[str], cand: EngineRequest,
             pinned: set[int] | None = None) -> float:
        """KV tokens left with ``cand`` admitted (its prompt and first token) and a slot kept for every request's
        next token (vLLM schedules the running requests' next tokens before it admits): no future reserved."""
        if isinstance(entries, BatchMemory):
            raise TypeError("vLLM admission is asked with the batch's entries")
        if len(entries) + 1 > self.max_num_seqs:
            return NO_SEAT
        own, shared = self._own_and_shared(cand, pinned)
        return self.kv_tokens - sum(used for used, _ in entries) - own - shared - (len(entries) + 1)

    def _decode(self, now: float) -> Step:
        self._preempt_for_next_tokens()
        return super()._decode(now)

    def _preempt_for_next_tokens(self) -> None:
        """Free KV for every running request's next token by preempting the last admitted, as often as needed
        (one request alone always fits: ``add`` refuses a request larger than the cache)."""
        while len(self.running) > 1 and self.kv_used_tokens + len(self.running) > self.kv_tokens:
            victim = self.running.pop()
            self._release(victim)
            self.queue.push_front(victim)
            self.preemptions_total += 1

    def decode_run(self, now: float, horizon: float) -> Step:
        raise NotImplementedError("decode_run never preempts: step this engine one step at a time")
