"""The engine model: continuous batching under a KV-token capacity, with a prefix cache.

Pure and clock-free: ``step(now)`` plans and applies one engine iteration and returns how long it takes and
which requests got a token or finished. The discrete-event simulator advances virtual time by that duration;
the emulated vLLM server sleeps it (divided by its speed factor). Semantics follow the VTC artifact
(docs/simulator/index.md#vtc-engine):

- a prefill step admits a mini-batch and emits each new request's first token; the running batch is not
  decoded during it; a decode step emits one token for every running request;
- admission is tried when the batch is empty, and otherwise after every ``admit_every`` decode steps;
- the memory rule reserves each request's whole future (prompt + output), so there is no preemption and no
  OOM: sort (used, remaining) by remaining descending; admit iff max_k(remaining_k·k + Σ_{j≤k} used_j) ≤ M;
- admission stops at the first request that does not fit (head-of-line), unless the queue's policy skips
  requests that do not fit and goes on (DLPM, Algorithm 1: ``skips_unfit``);
- with a prefix cache, memory is counted as a radix cache holds it: every whole prompt block of the running
  requests once (held while any of them uses it, never evicted then), plus each request's own tail (its last
  partial block and its output), so requests that share a prefix make larger decode batches
  (docs/simulator/index.md#prefix-cache); a finished request's prompt *and output* stay cached
  (``output_blocks``) until evicted (LRU), so a conversation's next turn or a ToT child hits.

The waiting queue is pluggable: FIFO for an emulated vLLM (and the engines behind the gateway in the
simulator), or a fair scheduler when the policy decides admissions inside the engine (the paper's setting).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from fairgate.accounting.prefix import block_hashes
from fairgate.engine.memory_rule import BatchMemory
from fairgate.engine.prefix_cache import PrefixCache
from fairgate.engine.profiles import EngineProfile


@dataclass(slots=True, eq=False)
class EngineRequest:
    id: str
    prompt_len: int
    output_len: int  # tokens this request will generate (≤ max_tokens)
    prompt_ids: Sequence[int] = ()  # token ids for the prefix cache (empty: no caching)
    cache_salt: str | None = None  # vLLM's: prefixes are shared only among requests with the same salt
    blocks: list[int] | None = None  # the prompt's block hashes (given by the simulator, else from prompt_ids)
    output_blocks: Sequence[int] = ()  # prompt + output block hashes, cached when it finishes
    arrival: float = 0.0
    client: str = ""
    generated: int = 0
    cached_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    aborted: bool = False
    _held: list[int] = field(default_factory=list, repr=False)  # its whole prompt blocks, while it runs
    _block_set: frozenset[int] | None = field(default=None, repr=False)  # the same, as a set (fit checks)

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def context(self) -> int:
        return self.prompt_len + self.generated

    def prompt_blocks(self, block_size: int) -> list[int]:
        if self.blocks is None:
            self.blocks = block_hashes(self.prompt_ids, block_size, self.cache_salt) if self.prompt_ids else []
        return self.blocks

    def block_set(self, block_size: int) -> frozenset[int]:
        if self._block_set is None:
            self._block_set = frozenset(self.prompt_blocks(block_size))
        return self._block_set


@dataclass(slots=True)
class Step:
    kind: str  # "prefill" | "decode"
    start: float
    duration: float
    emitted: list[EngineRequest]  # each got exactly one new token at start + duration
    finished: list[EngineRequest]
    ends: list[float] | None = None  # a run of decode steps (``decode_run``): each one's end, the last its own


NO_SEAT = float("-inf")  # ``room`` when the batch has no seat left (max_num_seqs)


class RequestTooLarge(ValueError):
    pass


class FifoQueue:
    """The engine's own waiting queue, first come first served (what vLLM does by default)."""

    def __init__(self) -> None:
        self._q: deque[EngineRequest] = deque()

    def push(self, req: EngineRequest, now: float) -> bool:
        self._q.append(req)
        return True

    def peek(self, now: float, fits=None) -> EngineRequest | None:
        while self._q and self._q[0].aborted:
            self._q.popleft()
        return self._q[0] if self._q else None

    def pop(self, req: EngineRequest, now: float) -> None:
        self._q.popleft()

    def push_front(self, req: EngineRequest) -> None:
        """A preempted request goes back to the head (engine/vllm_engine.py)."""
        self._q.appendleft(req)

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
        self._held: dict[int, int] = {}  # prompt block → running requests that use it
        self._tail = 0  # Σ over running requests of their own KV (context less whole held blocks): _tails()
        self._unheld: dict[str, int] = {}  # request id → its prompt blocks not held, while _held stands
        self._looked: dict[str, int] = {}  # request id → cached_tokens, while the cache's version stands
        self._looked_at = -1
        self._decodes_since_admit = 0
        self._aborts = False
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.finished_total = 0
        self.busy_s = 0.0  # the modelled GPU time of every step so far (prefill and decode)
        self.runs = 0  # decode_run's calls
        self.preemptions_total = 0  # never here: every running request's future is reserved (engine/vllm_engine.py)

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
        return self._tail + len(self._held) * self.profile.block_size

    def _tails(self) -> int:
        """``_tail`` as defined (it is kept as requests start, decode, finish and are dropped)."""
        bs = self.profile.block_size
        return sum(r.context - len(r._held) * bs for r in self.running)

    def cached_tokens(self, req: EngineRequest) -> int:
        """Prompt tokens the prefix cache would serve this request now (a look, not a use; kept until the
        cache's content moves, for a policy that looks at every candidate at every decision)."""
        if self.cache is None:
            return 0
        if self._looked_at != self.cache.version:
            self._looked_at, self._looked = self.cache.version, {}
        tokens = self._looked.get(req.id)
        if tokens is None:
            blocks = req.prompt_blocks(self.profile.block_size)
            tokens = self._looked[req.id] = self.cache.cached_tokens(blocks, req.prompt_len) if blocks else 0
        return tokens

    def quiet(self) -> bool:
        """A batch to decode and nothing waiting or aborted: ``step`` would decode (``decode_run``'s case)."""
        return bool(self.running) and not len(self.queue) and not self._aborts

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
                    self._release(r)
            self.running = [r for r in self.running if not r.aborted]


    def entries(self) -> list[tuple[int, int]]:
        """(own used, remaining) KV tokens of every running request, for the memory rule (its whole prompt
        blocks are not its own: they are counted once for the batch, in the held blocks)."""
        bs = self.profile.block_size
        return [(r.context - len(r._held) * bs, r.output_len - r.generated) for r in self.running]

    def fits(self, entries: list[tuple[int, int]] | BatchMemory, clients: set[str], cand: EngineRequest,
             pinned: set[int] | None = None) -> bool:
        """Would ``cand`` fit beside ``entries`` (running plus already chosen, or their ``BatchMemory``) under
        the memory rule (engine/memory_rule.py)? ``pinned``: prompt blocks the batch being formed adds, beyond
        those running requests hold."""
        return self.room(entries, clients, cand, pinned) >= 0

    def room(self, entries: list[tuple[int, int]] | BatchMemory, clients: set[str], cand: EngineRequest,
             pinned: set[int] | None = None) -> float:
        """KV tokens left at the batch's peak with ``cand`` in it: ≥ 0 if it fits; negative, how many it lacks
        (−inf: no seat left). A decode step that finishes nothing raises it by at most 1 + the batch's requests
        that do not decode (engine/memory_rule.py ``DRIFT``), which lets a refusal be kept across such steps."""
        memory = entries if isinstance(entries, BatchMemory) else BatchMemory(entries)
        if memory.n + 1 > self.max_num_seqs:
            return NO_SEAT
        own, shared = self._own_and_shared(cand, pinned)
        need = memory.need_with(own, cand.output_len - cand.generated - 1)
        n_clients = (len(clients) + (cand.client not in clients)) if self.client_reserve else 0
        return self.kv_tokens - self.client_reserve * n_clients - need - shared

    def _own_and_shared(self, cand: EngineRequest, pinned: set[int] | None) -> tuple[int, int]:
        """``cand``'s own KV tokens once its prefill has emitted its first token (its context less its whole
        prompt blocks), and the tokens of the prompt blocks the batch would hold with it: those running requests
        hold, those the forming batch adds (``pinned``) and its own that neither does."""
        bs = self.profile.block_size
        blocks = cand.prompt_blocks(bs) if self.cache is not None else ()
        extra = 0
        if blocks:  # its blocks no running request holds and the forming batch does not add (set operations)
            if pinned:
                extra = len(cand.block_set(bs).difference(self._held).difference(pinned))
            else:
                extra = self._unheld.get(cand.id)
                if extra is None:  # (_held is a dict: looked up, not copied)
                    extra = self._unheld[cand.id] = len(cand.block_set(bs).difference(self._held))
        return cand.context + 1 - len(blocks) * bs, (len(self._held) + len(pinned or ()) + extra) * bs

    def room_any(self, memory: BatchMemory, clients: set[str], own: int, remaining: int) -> float:
        """The most ``room`` any request whose own KV (``prompt_len + 1`` less its whole prompt blocks) is at
        least ``own`` and whose ``output_len - 1`` is at least ``remaining`` could have: ``room`` with the least
        a candidate can add (its blocks all held already, its client already running; the need grows with
        each)."""
        if memory.n + 1 > self.max_num_seqs:
            return NO_SEAT
        need = memory.need_with(own, remaining) + len(self._held) * self.profile.block_size
        return self.kv_tokens - self.client_reserve * (len(clients) if self.client_reserve else 0) - need

    def _admit(self, now: float) -> list[EngineRequest]:
        new: list[EngineRequest] = []
        pinned: set[int] = set()
        batch = [0]  # prompt tokens this prefill computes
        formed: list[tuple[list[tuple[int, int]], set[str]]] = []  # the batch's entries and clients, built
        # when the queue first offers a candidate (the queue is asked even when nothing lives in it: a
        # policy's peek does its bookkeeping, VTC's dropping a client whose last request was given up)

        def admissible(cand: EngineRequest) -> bool:
            if not formed:
                formed.append((self.entries(), {r.client for r in self.running}))
            extend = cand.context - self.cached_tokens(cand)
            return (not new or batch[0] + extend <= self.max_batch_prompt_tokens) and \
                self.fits(*formed[0], cand, pinned)

        while (cand := self.queue.peek(now, admissible)) is not None:
            if not admissible(cand):
                break  # head-of-line: never skip to a smaller request (unless the policy does, above)
            entries, clients = formed[0]
            blocks = cand.prompt_blocks(self.profile.block_size) if self.cache is not None else ()
            entries.append((cand.context + 1 - len(blocks) * self.profile.block_size,
                            cand.output_len - cand.generated - 1))
            pinned.update(h for h in blocks if h not in self._held)
            clients.add(cand.client)
            batch[0] += cand.context - self.cached_tokens(cand)
            self.queue.pop(cand, now)
            new.append(cand)
        self._decodes_since_admit = 0 if new else self._decodes_since_admit
        return new

    def _prefill(self, now: float, new: list[EngineRequest]) -> Step:
        computed, attended = 0, 0.0
        bs = self.profile.block_size
        for r in new:
            first = r.first_token_at is None  # (else a preempted request resumes: engine/vllm_engine.py)
            cached = 0
            if self.cache is not None and r.prompt_blocks(bs):
                cached = self.cache.lookup_blocks(r.blocks, r.prompt_len)
                r._held = r.blocks
                self._unheld.clear()
                for h in r._held:
                    self._held[h] = self._held.get(h, 0) + 1
            if first:
                r.admitted_at, r.cached_tokens = now, cached
                self.prompt_tokens_total += r.prompt_len
            extend = r.context - cached  # (a resumed one computes its output again too)
            computed += extend
            attended += extend * (cached + extend / 2)
        if self.cache is not None:
            reserved = -(-(self._tail + sum(r.context - len(r._held) * bs for r in new)) // bs)
            for r in new:
                if r.blocks:
                    self.cache.insert(r.blocks, reserved, self._held, r.prompt_ids, r.cache_salt)
        duration = self.profile.prefill_time(computed, attended)
        self.running.extend(new)
        self._tail += sum(r.context - len(r._held) * bs for r in new)
        return self._emit(Step("prefill", now, duration, new, []), now + duration)

    def _release(self, r: EngineRequest) -> None:
        """``r`` leaves the running batch (finished, aborted or preempted): its own KV and its hold on its prompt
        blocks are freed."""
        self._tail -= r.context - len(r._held) * self.profile.block_size
        if r._held:
            self._unheld.clear()
        for h in r._held:
            left = self._held[h] - 1
            if left:
                self._held[h] = left
            else:
                del self._held[h]
        r._held = []

    def _decode(self, now: float) -> Step:
        duration = self.profile.decode_time(len(self.running), self.kv_used_tokens)
        self._decodes_since_admit += 1
        return self._emit(Step("decode", now, duration, list(self.running), []), now + duration)

    def decode_run(self, now: float, horizon: float) -> Step:
        """What ``step`` does, called again at each step's end, while nothing waits here (no admission to try,
        nothing aborted): decode steps back to back, each that starts before ``horizon``, up to the first that
        finishes a request. One Step for the run: every running request got ``len(ends)`` tokens, the last at
        ``ends[-1]``; the same times, token counts and KV as step by step (the simulator's quiet periods:
        sim/gate.py). O(steps) arithmetic, O(batch) bookkeeping."""
        running = self.running
        b, left = len(running), min(r.output_len - r.generated for r in running)
        used, t, ends = self.kv_used_tokens, now, []
        decode_time = self.profile.decode_time
        while True:
            d = decode_time(b, used)
            self.busy_s += d
            t += d
            ends.append(t)
            used += b
            if len(ends) >= left or t >= horizon:  # (the next step would start at or after it)
                break
        m = len(ends)
        self.runs += 1
        self._decodes_since_admit += m
        finished = []
        for r in running:
            r.generated += m
            if r.generated >= r.output_len:
                r.finished_at = t
                finished.append(r)
        self.generation_tokens_total += b * m
        self._tail += b * m
        step = Step("decode", now, t - now, list(running), finished, ends)
        if finished:
            self._finish(finished)
        return step

    def _emit(self, step: Step, end: float) -> Step:
        self.busy_s += step.duration
        for r in step.emitted:
            r.generated += 1
            if r.first_token_at is None:
                r.first_token_at = end
            if r.generated >= r.output_len:
                r.finished_at = end
                step.finished.append(r)
        self.generation_tokens_total += len(step.emitted)
        self._tail += len(step.emitted)
        if step.finished:
            self._finish(step.finished)
        return step

    def _finish(self, finished: list[EngineRequest]) -> None:
        self.finished_total += len(finished)
        self.running = [r for r in self.running if not r.done]
        bs = self.profile.block_size
        for r in finished:
            self._release(r)
        if self.cache is not None:
            reserved = -(-self._tail // bs)
            for r in finished:
                if r.output_blocks:  # its prompt and output stay cached (a next turn, a ToT child)
                    self.cache.insert(r.output_blocks, reserved, self._held)
