"""Engine profiles of a model on N_g GPUs of one kind (tensor parallelism), and the per-GPU throughput each
degree gives (Aladdin §4.1, Eqs. 5-6; docs/simulator/index.md#tensor-parallel). Pure.

A worker of N_g GPUs holds the weights W split N_g ways and the KV cache in what is left:
M = (N_g · m_gpu · u − W) / kv_per_token. Decode reads the weights and the batch's KV once per step, so a step
is memory-bound (Eq. 5's t_compute = k4/N_g + c4, the k4 part divided among the GPUs), plus the all-reduces
tensor parallelism adds, two per layer, whose cost grows as (N_g − 1)/N_g:

  t_d(b, L) = (W + kv·L) / (N_g · bw) + b · 2P / (N_g · F) + (N_g − 1)/N_g · (a + b · v)
  t_p(l)    = l · 2P / (N_g · F_p) + c1 + (N_g − 1)/N_g · (a + l · v)

with P the parameters, bw and F the GPU's effective memory bandwidth and compute, a = 2·layers·(an all-reduce's
latency) and v = 2·layers·hidden·2 bytes · 2 / (the link's bandwidth) per token. The efficiencies are set from
anchors derived from the Aladdin paper's Table 2 targets ( an unbatched step of 11.5 ms for 7B and 23.1 ms for 13B on an A100,
23.1 ms for 7B on a V100; a prefill of at most ≈ 0.1 ms per token for 7B on an A100); the links are PCIe, as
the paper's testbed.

Eq. 6: T_max(N_g) = min(M / (N_g · m_r · t_it), B / (N_g · T_dec)) tokens per second per GPU, with
m_r the mean KV a request holds at its peak (l_in + l_out: AMBIG-3 of docs/policies/aladdin.md#open-choices, at peak), t_it a step at the
KV-bound batch M / m_r, and B the batch whose step at the mean context l_ave = l_in + l_out / 2 takes the ATGT
target T_dec (Eq. 4 solved for b). The best degree maximises it; it depends on the model, the GPU, the lengths
and the target, not on the arrival rate. What T_dec is at each degree is AMBIG-3 (docs/policies/aladdin.md#open-choices): Table 2's rule
(1.3× the worker's own unbatched step) reproduces the paper's Table 3; one absolute target for every degree
(what a platform promises, and what ``fairgate plan --tp`` uses when the workload has one) favours more GPUs
per worker, since splitting the weights frees most of a tight step for batching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from fairgate.engine.engine_profile import EngineProfile

BYTES = 2  # bf16 / fp16 weights and KV


@dataclass(frozen=True, slots=True)
class Gpu:
    name: str
    memory_gb: float  # GiB, as the cards are sold (80 GB = 80 GiB)
    bandwidth_gbs: float  # effective HBM bandwidth of a decode step (the anchors' share of the datasheet's)
    flops_t: float  # effective TFLOPS of a decode step's matrix products (small batches)
    prefill_flops_t: float  # effective TFLOPS of a prefill
    allreduce_s: float  # one small all-reduce's latency over the link
    link_gbs: float  # the link's effective all-reduce bandwidth


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int = 128

    @property
    def weight_bytes(self) -> float:
        return self.params * BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        """Eq. 1's h: K and V of every layer (GQA: only the KV heads)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES


GPUS = {
    # A100-80GB PCIe: 1,935 GB/s and 312 TFLOPS on the datasheet; 1,150 GB/s effective makes the anchors'
    # unbatched steps (7B 11.5 ms, 13B 23.1 ms: 12.3 and 23.5 here, over 1,000 tokens of context). PCIe Gen4.
    "a100-80gb": Gpu("a100-80gb", 80, 1150, 150, 156, 25e-6, 20),
    # V100-32GB: 900 GB/s and 125 TFLOPS; 584 GB/s effective makes 7B's 23.1 ms. PCIe Gen3.
    "v100-32gb": Gpu("v100-32gb", 32, 584, 60, 69, 40e-6, 10),
}

MODELS = {
    "llama2-7b": Model("llama2-7b", 6.74e9, 32, 4096, 32),
    "llama2-13b": Model("llama2-13b", 13.0e9, 40, 5120, 40),
    "llama2-70b": Model("llama2-70b", 69.0e9, 80, 8192, 8),  # grouped-query attention: 8 KV heads
}

DEGREES = (1, 2, 4, 8)  # GPUs per worker, at most a node's


def kv_tokens(model: Model, gpu: Gpu, tp: int, utilization: float = 0.9) -> int:
    """M: the KV cache's tokens on ``tp`` GPUs (vLLM's gpu_memory_utilization); ≤ 0: the weights do not fit."""
    return int((tp * gpu.memory_gb * 2**30 * utilization - model.weight_bytes) // model.kv_bytes_per_token)


def worker_profile(model: Model, gpu: Gpu, tp: int, max_num_seqs: int = 256) -> EngineProfile | None:
    """The engine profile of ``model`` on ``tp`` GPUs (None if its weights do not fit)."""
    m = kv_tokens(model, gpu, tp)
    if tp < 1 or m <= 0:
        return None
    bw, share = gpu.bandwidth_gbs * 1e9, (tp - 1) / tp
    a = 2 * model.layers * gpu.allreduce_s  # two all-reduces per layer
    v = 2 * model.layers * model.hidden * BYTES * 2 / (gpu.link_gbs * 1e9)  # their bytes per token (ring: ×2)
    return EngineProfile(
        name=f"{model.name}@{gpu.name}:tp{tp}", kv_tokens=m, max_num_seqs=max_num_seqs,
        k1=2 * model.params / (tp * gpu.prefill_flops_t * 1e12) + share * v, c1=0.005 + share * a,
        k2=model.kv_bytes_per_token / (tp * bw), c2=2 * model.params / (tp * gpu.flops_t * 1e12) + share * v,
        c3=model.weight_bytes / (tp * bw) + share * a, max_model_len=min(4096, m), gpus=tp,
        admit_every=1)  # (vLLM's scheduler, as Aladdin's testbed ran)


@dataclass(frozen=True, slots=True)
class Degree:
    """Eq. 6 at one degree: both bounds, in output tokens per second per GPU."""

    tp: int
    kv_tokens: int
    atgt_s: float  # T_dec
    kv_batch: float  # M / m_r (at most the batch cap)
    slo_batch: float  # B: the batch whose step takes T_dec
    kv_bound: float
    slo_bound: float

    @property
    def per_gpu(self) -> float:
        return min(self.kv_bound, self.slo_bound)


RELATIVE = 1.3  # Table 2's rule: a batched step may take 1.3× the individual (unbatched) one


def degree(model: Model, gpu: Gpu, tp: int, atgt_s: float | None, mean_in: float, mean_out: float) -> Degree | None:
    """Eq. 6 at ``tp`` GPUs (None: the weights do not fit). ``atgt_s`` None: T_dec is Table 2's rule applied to
    this worker, 1.3× its own unbatched step at the mean context (the paper sets its targets so;
    AMBIG-3 of docs/policies/aladdin.md#open-choices), else the target as given (one absolute target for every degree)."""
    p = worker_profile(model, gpu, tp)
    if p is None:
        return None
    if not (mean_in >= 0 and mean_out >= 1 and math.isfinite(mean_in + mean_out)):
        raise ValueError("Eq. 6 needs finite mean lengths, an output of at least one token")
    m_r, l_ave = mean_in + mean_out, mean_in + mean_out / 2
    t_dec = atgt_s if atgt_s is not None else RELATIVE * p.decode_time(1, round(l_ave))
    kv_batch = min(p.kv_tokens / m_r, float(p.max_num_seqs))
    step = p.decode_time(max(1, round(kv_batch)), round(kv_batch * l_ave))
    slo_batch = max(0.0, min((t_dec - p.c3) / (p.k2 * l_ave + p.c2), float(p.max_num_seqs)))
    return Degree(tp, p.kv_tokens, t_dec, kv_batch, slo_batch, kv_batch / (tp * step), slo_batch / (tp * t_dec))


def best_degree(model: Model, gpu: Gpu, atgt_s: float | None, mean_in: float, mean_out: float,
                degrees: tuple[int, ...] = DEGREES) -> tuple[list[Degree], Degree | None]:
    """Eq. 6 at each degree the weights fit in, and N_g^opt = argmax T_max (None: none serves the target)."""
    rows = [d for tp in degrees if (d := degree(model, gpu, tp, atgt_s, mean_in, mean_out)) is not None]
    best = max(rows, key=lambda d: d.per_gpu, default=None)
    return rows, best if best is not None and best.per_gpu > 0 else None


def parse(name: str) -> EngineProfile | None:
    """``MODEL@GPU[:tpN][:decode]`` as an engine profile (None if ``name`` is not of that form). ``decode``: a
    decode-only worker of a split-phase pool (the paper's Fig. 12), its requests prefilled elsewhere and their KV
    handed over at no cost (AMBIG-11, docs/policies/aladdin.md#open-choices: the handoff latency is not modelled)."""
    model_name, at, rest = name.partition("@")
    if not at:
        return None
    gpu_name, *options = rest.split(":")
    model, gpu = MODELS.get(model_name), GPUS.get(gpu_name)
    tps = [int(o[2:]) if o[2:].isdigit() else 0 for o in options if o.startswith("tp")]
    tp = tps[0] if len(tps) == 1 else 1 if not tps else 0
    unknown = [o for o in options if not o.startswith("tp") and o != "decode"]
    if model is None or gpu is None or tp not in DEGREES or unknown or len(options) > len(set(options)):
        raise ValueError(f"unknown engine {name!r}: MODEL@GPU[:tpN][:decode] with MODEL one of "
                         f"{', '.join(MODELS)}, GPU one of {', '.join(GPUS)}, N one of {', '.join(map(str, DEGREES))}")
    profile = worker_profile(model, gpu, tp)
    if profile is None:
        raise ValueError(f"{model.name} does not fit on {tp} × {gpu.name}")
    if "decode" in options:
        profile = replace(profile, name=profile.name + ":decode", k1=0.0, c1=0.0)
    return profile
