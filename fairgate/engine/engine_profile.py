"""An engine profile: the KV capacity and the latency model of one engine (a model on its GPUs), in Aladdin's
linear forms (§3: prefill Eq. 2, decode Eq. 3). The named profiles are in engine/profiles.py; profiles derived
from GPU and model specifications in engine/tensor_parallel.py."""

from __future__ import annotations

from dataclasses import dataclass, replace

from fairgate.accounting.latency import LatencyModel


@dataclass(frozen=True, slots=True)
class EngineProfile:
    name: str
    kv_tokens: int  # M: KV-cache capacity in tokens
    max_num_seqs: int  # running-batch cap (vLLM --max-num-seqs; the VTC artifact's running_max_req_size)
    k1: float  # prefill seconds per computed prompt token
    c1: float  # prefill fixed cost, seconds
    k2: float  # decode seconds per context token in the batch
    c2: float  # decode seconds per sequence in the batch
    c3: float  # decode fixed cost per step, seconds
    block_size: int = 16  # KV / prefix-cache block size in tokens
    max_model_len: int = 4096
    k_attn: float = 0.0  # prefill attention, seconds per (computed token × context token it attends to)
    gpus: int = 1  # GPUs per worker (tensor parallelism: engine/tensor_parallel.py)
    # decode steps between admissions while a batch runs: 10, the VTC artifact's engine (LightLLM's
    # max_wait_tokens); 1, vLLM's scheduler, which takes waiting requests at every step
    admit_every: int = 10

    @property
    def latency(self) -> LatencyModel:
        """Its prefill and decode step as a latency model (the attention term aside)."""
        return LatencyModel(self.k1, self.c1, self.k2, self.c2, self.c3)

    def prefill_time(self, computed_tokens: int, attended: float = 0.0) -> float:
        """``attended``: Σ extend · (prefix + extend / 2) over the batch
        (docs/simulator/index.md#prefix-cache): a cached prefix is not computed again, but the tokens computed
        after it still attend to it."""
        return self.k1 * computed_tokens + self.k_attn * attended + self.c1

    def decode_time(self, batch_size: int, context_tokens: int) -> float:
        return self.k2 * context_tokens + self.c2 * batch_size + self.c3

    def scaled(self, speed: float) -> "EngineProfile":
        """The same engine ``speed`` times as fast (a heterogeneous pool's faster or slower member)."""
        if speed == 1:
            return self
        return replace(self, name=f"{self.name}x{speed:g}", k1=self.k1 / speed, c1=self.c1 / speed,
                       k2=self.k2 / speed, c2=self.c2 / speed, c3=self.c3 / speed, k_attn=self.k_attn / speed)

    def with_overrides(self, **kw) -> "EngineProfile":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
