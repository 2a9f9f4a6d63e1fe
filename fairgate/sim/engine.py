"""The engine model: continuous batching under a KV-token capacity, with a prefix cache.

Pure and clock-free: ``step(now)`` plans and applies one engine iteration and returns how long it takes and
which requests got a token or finished. The discrete-event simulator advances virtual time by that duration;
the emulated vLLM server sleeps it (divided by its speed factor). Semantics follow the VTC artifact
(notes/vtc.md §2.1, §5.2):

- a prefill step admits a mini-batch and emits each new request's first token; the running batch is not
  decoded during it; a decode step emits one token for every running request;
- admission is tried when the batch is empty, and otherwise after every ``admit_every`` decode steps;
- the memory rule reserves each request's whole future (prompt + output), so there is no preemption and no
  OOM: sort (used, remaining) by remaining descending; admit iff max_k(remaining_k·k + Σ_{j≤k} used_j) ≤ M;
- admission stops at the first request that does not fit (head-of-line; no skipping).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from fairgate.sim.prefix_cache import PrefixCache
from fairgate.sim.profiles import EngineProfile


@dataclass(slots=True, eq=False)
class EngineRequest:
    id: str
    prompt_len: int
    output_len: int  # tokens this request will generate (≤ max_tokens)
    prompt_ids: Sequence[int] = ()  # token ids for the prefix cache (empty: no caching)
    arrival: float = 0.0
    generated: int = 0
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    _hashes: list[int] = field(default_factory=list, repr=False)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated


@dataclass(slots=True)
class Step:
    kind: str  # "prefill" | "decode"
    start: float
    duration: float
    emitted: list[EngineRequest]  # each got exactly one new token at start + duration
    finished: list[EngineRequest]


class RequestTooLarge(ValueError):
    pass


class Engine:
    def __init__(self, profile: EngineProfile, *, admit_every: int = 1, prefix_caching: bool = True,
                 max_batch_prompt_tokens: int | None = None):
        self.profile = profile
        self.kv_tokens = profile.kv_tokens
        self.max_num_seqs = profile.max_num_seqs
        self.admit_every = admit_every
        self.max_batch_prompt_tokens = max_batch_prompt_tokens or max(profile.kv_tokens // 6, 3072)
        bs = profile.block_size
        self.cache = PrefixCache(profile.kv_tokens // bs, bs) if prefix_caching else None
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self._decodes_since_admit = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0

    # -- intake ---------------------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        if req.prompt_len + req.output_len > self.kv_tokens:
            raise RequestTooLarge(
                f"request needs {req.prompt_len + req.output_len} KV tokens; the engine holds {self.kv_tokens}")
        self.waiting.append(req)

    def abort(self, req: EngineRequest) -> None:
        req.aborted = True  # removed at the next step boundary

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    # -- views (vLLM's /metrics) ----------------------------------------------------------------------
    @property
    def kv_used_tokens(self) -> int:
        return sum(r.context for r in self.running)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used_tokens / self.kv_tokens)

    # -- one iteration --------------------------------------------------------------------------------
    def step(self, now: float) -> Step | None:
        self._drop_aborted(now)
        if not self.running or self._decodes_since_admit >= self.admit_every:
            new = self._admit(now)
            if new:
                return self._prefill(now, new)
        if not self.running:
            return None
        return self._decode(now)

    def _drop_aborted(self, now: float) -> None:
        if any(r.aborted for r in self.running):
            for r in self.running:
                if r.aborted:
                    r.finished_at = now
            self.running = [r for r in self.running if not r.aborted]
        if any(r.aborted for r in self.waiting):
            self.waiting = deque(r for r in self.waiting if not r.aborted)

    def _fits(self, entries: list[tuple[int, int]]) -> bool:
        entries.sort(key=lambda e: e[1], reverse=True)
        need, used_sum = 0, 0
        for k, (used, remaining) in enumerate(entries, start=1):
            used_sum += used
            need = max(need, remaining * k + used_sum)
        return need <= self.kv_tokens

    def _admit(self, now: float) -> list[EngineRequest]:
        entries = [(r.context, r.output_len - r.generated) for r in self.running]
        new: list[EngineRequest] = []
        batch_prompt = 0
        while self.waiting and len(self.running) + len(new) < self.max_num_seqs:
            cand = self.waiting[0]
            if new and batch_prompt + cand.prompt_len > self.max_batch_prompt_tokens:
                break
            trial = entries + [(cand.prompt_len + 1, cand.output_len - 1)]
            if not self._fits(trial):
                break  # head-of-line: never skip to a smaller request
            entries = trial
            batch_prompt += cand.prompt_len
            new.append(self.waiting.popleft())
        self._decodes_since_admit = 0 if new else self._decodes_since_admit
        return new

    def _prefill(self, now: float, new: list[EngineRequest]) -> Step:
        computed = 0
        for r in new:
            r.admitted_at = now
            if self.cache is not None and r.prompt_ids:
                r.cached_tokens, r._hashes = self.cache.lookup(r.prompt_ids)
            computed += r.prompt_len - r.cached_tokens
            self.prompt_tokens_total += r.prompt_len
        if self.cache is not None:
            reserved = (self.kv_used_tokens + sum(r.prompt_len for r in new)) // self.profile.block_size
            for r in new:
                self.cache.insert(r._hashes, reserved)
        duration = self.profile.prefill_time(computed)
        self.running.extend(new)
        return self._emit(Step("prefill", now, duration, new, []), now + duration)

    def _decode(self, now: float) -> Step:
        duration = self.profile.decode_time(len(self.running), self.kv_used_tokens)
        self._decodes_since_admit += 1
        return self._emit(Step("decode", now, duration, list(self.running), []), now + duration)

    def _emit(self, step: Step, end: float) -> Step:
        for r in step.emitted:
            r.generated += 1
            if r.first_token_at is None:
                r.first_token_at = end
            if r.generated >= r.output_len:
                r.finished_at = end
                step.finished.append(r)
        self.generation_tokens_total += len(step.emitted)
        if step.finished:
            self.finished_total += len(step.finished)
            self.running = [r for r in self.running if not r.done]
        return step
