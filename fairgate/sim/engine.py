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

The waiting queue is pluggable: FIFO for an emulated vLLM (and the engines behind the gateway in the
simulator), or a fair scheduler when the policy decides admissions inside the engine (the paper's setting).
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
    cache_salt: str | None = None  # vLLM's: prefixes are shared only among requests with the same salt
    arrival: float = 0.0
    client: str = ""
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


class FifoQueue:
    """The engine's own waiting queue, first come first served (what vLLM does by default)."""

    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def push(self, req: EngineRequest, now: float) -> bool:
        self._q.append(req)
        return True

    def peek(self, now: float) -> EngineRequest | None:
        while self._q and self._q[0].aborted:
            self._q.popleft()
        return self._q[0] if self._q else None

    def pop(self, req: EngineRequest, now: float) -> None:
        self._q.popleft()

    def prune(self) -> None:
        self._q = deque(r for r in self._q if not r.aborted)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return (r for r in self._q if not r.aborted)


class Engine:
    def __init__(self, profile: EngineProfile, *, admit_every: int = 1, prefix_caching: bool = True,
                 max_batch_prompt_tokens: int | None = None, queue=None, client_reserve: int = 0):
        self.profile = profile
        self.client_reserve = client_reserve  # KV tokens held per distinct client in the batch (the artifact's 32)
        self.kv_tokens = profile.kv_tokens
        self.max_num_seqs = profile.max_num_seqs
        self.admit_every = admit_every
        self.max_batch_prompt_tokens = max_batch_prompt_tokens or max(profile.kv_tokens // 6, 3072)
        bs = profile.block_size
        self.cache = PrefixCache(profile.kv_tokens // bs, bs) if prefix_caching else None
        self.queue = queue if queue is not None else FifoQueue()
        self.running: list[EngineRequest] = []
        self._decodes_since_admit = 0
        self._aborts = False
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0

    # -- intake ---------------------------------------------------------------------------------------
    def add(self, req: EngineRequest, now: float = 0.0) -> bool:
        """Queue a request; False if the queue's policy rejected it."""
        if req.prompt_len + req.output_len > self.kv_tokens - self.client_reserve:
            raise RequestTooLarge(
                f"request needs {req.prompt_len + req.output_len} KV tokens; the engine holds {self.kv_tokens}")
        return self.queue.push(req, now)

    def abort(self, req: EngineRequest) -> None:
        req.aborted = True  # removed at the next step boundary
        self._aborts = True

    @property
    def waiting(self) -> int:
        return len(self.queue)

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
        if not self._aborts:
            return
        self._aborts = False
        if hasattr(self.queue, "prune"):
            self.queue.prune()
        if any(r.aborted for r in self.running):
            for r in self.running:
                if r.aborted:
                    r.finished_at = now
            self.running = [r for r in self.running if not r.aborted]

    def _fits(self, entries: list[tuple[int, int]], clients: int) -> bool:
        entries.sort(key=lambda e: e[1], reverse=True)
        need, used_sum = 0, 0
        for k, (used, remaining) in enumerate(entries, start=1):
            used_sum += used
            need = max(need, remaining * k + used_sum)
        return need <= self.kv_tokens - self.client_reserve * clients

    def entries(self) -> list[tuple[int, int]]:
        """(used, remaining) KV tokens of every running request, for the memory rule."""
        return [(r.context, r.output_len - r.generated) for r in self.running]

    def fits(self, entries: list[tuple[int, int]], clients: set[str], cand: EngineRequest) -> bool:
        """Would ``cand`` fit beside ``entries`` (running plus already chosen) under the memory rule?"""
        trial = entries + [(cand.prompt_len + 1, cand.output_len - 1)]
        return (len(trial) <= self.max_num_seqs
                and self._fits(trial, len(clients | {cand.client}) if self.client_reserve else 0))

    def _admit(self, now: float) -> list[EngineRequest]:
        entries = self.entries()
        clients = {r.client for r in self.running}
        new: list[EngineRequest] = []
        batch_prompt = 0
        while (cand := self.queue.peek(now)) is not None:
            if new and batch_prompt + cand.prompt_len > self.max_batch_prompt_tokens:
                break
            if not self.fits(entries, clients, cand):
                break  # head-of-line: never skip to a smaller request
            entries.append((cand.prompt_len + 1, cand.output_len - 1))
            clients.add(cand.client)
            batch_prompt += cand.prompt_len
            self.queue.pop(cand, now)
            new.append(cand)
        self._decodes_since_admit = 0 if new else self._decodes_since_admit
        return new

    def _prefill(self, now: float, new: list[EngineRequest]) -> Step:
        computed = 0
        for r in new:
            r.admitted_at = now
            if self.cache is not None and r.prompt_ids:
                r.cached_tokens, r._hashes = self.cache.lookup(r.prompt_ids, r.cache_salt)
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
