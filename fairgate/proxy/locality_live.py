"""The gateway's locality plumbing outside the request path: ``locality.*`` settings applied live (`fairgate
admin locality set`) and the Prometheus series of the prefix index, the hit rates and the deficits."""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Sequence

from fairgate.accounting.prefix import PrefixIndex
from fairgate.proxy.call import Call
from fairgate.proxy.config import LOCALITY_SETTINGS, GatewayConfig, LocalityConfig, locality_error
from fairgate.proxy.metrics import GatewayMetrics

log = logging.getLogger("fairgate.locality")


def locality_from_settings(base: LocalityConfig, settings: dict[str, str]) -> LocalityConfig:
    """``locality.*`` settings over the configured values; a bad value is logged and skipped."""
    changes: dict[str, Any] = {}
    for name in LOCALITY_SETTINGS:
        raw = settings.get(f"locality.{name}")
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if locality_error(name, value) is not None:
            log.warning("ignoring setting locality.%s = %r", name, raw)
            continue
        changes[name] = int(value) if name == "window" else value
    return replace(base, **changes)


def apply_locality(locality: LocalityConfig, config: GatewayConfig, scheduler, placement) -> None:
    """Give the running policy and placement their parameters from ``locality``."""
    if hasattr(scheduler, "set_params"):
        scheduler.set_params(**locality.policy_params(config.policy))
    if hasattr(placement, "set_params"):
        placement.set_params(**locality.placement_params(config.placement))
    log.info("locality parameters: %s", locality)


def record_prefix(m: GatewayMetrics, call: Call) -> None:
    """A finished call's prompt, cached and predicted tokens, per backend and per tenant."""
    t = call.tally
    m.prefix_tokens.labels(call.backend, "prompt").inc(t.prompt_tokens)
    m.prefix_tokens.labels(call.backend, "cached").inc(t.cached_tokens)
    if call.predicted_cached_tokens is not None:
        m.prefix_tokens.labels(call.backend, "predicted").inc(call.predicted_cached_tokens)
    if call.fairness_key:
        tenant = m.tenant(call.fairness_key)
        m.tenant_prefix_tokens.labels(tenant, "prompt").inc(t.prompt_tokens)
        m.tenant_prefix_tokens.labels(tenant, "cached").inc(t.cached_tokens)


def locality_gauges(m: GatewayMetrics, index: PrefixIndex | None, backends: Sequence[str], scheduler,
                    placement) -> None:
    """The prefix index's size per backend; DLPM's (or D²LPM's) deficits per tenant and backend."""
    if index is not None:
        for b in backends:
            m.prefix_index_blocks.labels(b).set(index.size(b))
    deficits: dict[str, dict[str, float]] = {}
    if hasattr(scheduler, "deficits"):
        deficits = {b: scheduler.deficits(b) for b in backends}
    elif isinstance(q := getattr(placement, "q", None), dict):
        for client, per_backend in q.items():
            for backend, value in per_backend.items():
                deficits.setdefault(backend, {})[client] = value
    for backend, per_client in deficits.items():
        for client, value in per_client.items():
            if math.isfinite(value):
                m.tenant_deficit.labels(m.tenant(client), backend).set(value)
