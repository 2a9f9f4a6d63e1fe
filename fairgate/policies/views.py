"""What a policy sees: plain snapshots of requests and backends, built by the caller (gateway or simulator)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestView:
    request_id: str
    client: str  # the fairness key (user by default)
    app: str
    model: str
    prompt_tokens: int
    max_tokens: int | None
    interaction: str = ""
    stage: int = 0
    arrival: float = 0.0
    true_output: int | None = None  # known only to the simulator (VTC(oracle)); never set in the gateway
    system_tokens: int = 0  # of prompt_tokens, how many are system/developer prompt (FairServe's L_S)
    final: bool = False  # the interaction's last call (the simulator knows; the gateway relies on expiry)
    blocks: tuple[int, ...] = ()  # the prompt's chained block hashes, salted per tenant (accounting/prefix.py)
    band: int = 1  # its SLO class's priority band: 0 interactive, 1 standard, 2 batch (policies/bands.py)
    ttft_s: float | None = None  # its latency targets (its SLO class's, tightened by its headers), if any
    atgt_s: float | None = None

    @property
    def in_interaction(self) -> bool:
        """Part of a multi-call interaction the client named (a call without one is its own)."""
        return bool(self.interaction) and self.interaction != self.request_id


@dataclass(frozen=True, slots=True)
class BackendView:
    name: str
    inflight: int  # requests the gateway has on it now
    inflight_tokens: int  # KV tokens the gateway's in-flight requests hold or will hold
    kv_capacity: int | None  # KV tokens, configured or scraped; None if unknown
    waiting: int = 0  # vllm:num_requests_waiting (last scrape)
    running: int = 0  # vllm:num_requests_running (last scrape)
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc (last scrape), 0..1

    @property
    def load(self) -> float:
        """Fraction of KV capacity committed by the gateway (requests if the capacity is unknown)."""
        if self.kv_capacity:
            return max(self.inflight_tokens / self.kv_capacity, self.kv_usage)
        return float(self.inflight + self.waiting)
