"""The gateway's locality plumbing outside the request path: ``locality.*`` settings applied live (`fairgate
admin locality set`) and the Prometheus series of the prefix index, the hit rates and the deficits."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from dataclasses import replace
from typing import Any, Sequence

import aiohttp

from fairgate.accounting.prefix import PrefixIndex, block_hashes, prompt_blocks
from fairgate.accounting.tokenizer import response_messages
from fairgate.policies.dlpm import DLPM
from fairgate.proxy.call import Call
from fairgate.proxy.config import LOCALITY_SETTINGS, GatewayConfig, LocalityConfig, locality_error
from fairgate.proxy.control.backends import Backend
from fairgate.proxy.control.metrics import GatewayMetrics

log = logging.getLogger("fairgate.locality")
_TOKENIZE_TIMEOUT = aiohttp.ClientTimeout(total=5.0)


def new_index(loc: LocalityConfig) -> PrefixIndex:
    """The prefix index: approximate (learned from dispatches, blocks expire after ``index_ttl_s``) or precise
    (fed by the backends' KV events, ``proxy/control/kv_subscriber.py``)."""
    precise = loc.index == "precise"
    return PrefixIndex(loc.block_size, None if precise else loc.index_ttl_s, precise=precise)


async def backend_token_ids(session: aiohttp.ClientSession, backends: Sequence[Backend], endpoint: str,
                            body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids under the model's own tokenizer and chat template: the first serving backend's
    ``/tokenize`` (vLLM's). One local round trip per request (``locality.tokenize: backend``), so a precise
    index matches the blocks the engine reports. None when it cannot say: the request then goes without
    locality, never fails."""
    if not backends:
        return None
    if endpoint == "chat":
        payload = {"model": body["model"], "messages": body["messages"], "add_generation_prompt": True,
                   **{k: body[k] for k in ("tools", "chat_template", "chat_template_kwargs") if body.get(k)}}
    elif endpoint == "responses":  # (vLLM's /tokenize takes messages: the conversation as it renders them)
        payload = {"model": body["model"], "add_generation_prompt": True,
                   "messages": response_messages(body.get("instructions"), body["input"]),
                   **{k: body[k] for k in ("tools",) if body.get(k)}}
    elif isinstance(body.get("prompt"), str):
        payload = {"model": body["model"], "prompt": body["prompt"]}
    else:
        return None
    try:
        async with session.post(backends[0].url + "/tokenize", json=payload, timeout=_TOKENIZE_TIMEOUT) as r:
            if r.status != 200:
                return None
            tokens = (await r.json()).get("tokens")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None
    return tokens if isinstance(tokens, list) and all(type(t) is int for t in tokens) else None


async def request_blocks(loc: LocalityConfig, tokenizer, endpoint: str, body: dict[str, Any], salt: str | None,
                         large: bool, session: aiohttp.ClientSession,
                         backends: Sequence[Backend]) -> tuple[tuple[int, ...], int | None]:
    """A request's prompt as salted block hashes for the prefix index, and the prompt's token count when the
    model's own tokenizer gave it (``tokenize: backend``; else None). A ``large`` prompt is hashed in a thread
    (tiktoken releases the GIL), not on the loop every stream uses."""
    if loc.tokenize == "backend":
        ids = await backend_token_ids(session, backends, endpoint, body)
        return (tuple(block_hashes(ids, loc.block_size, salt)), len(ids)) if ids else ((), None)
    hashing = functools.partial(prompt_blocks, tokenizer, endpoint, body, loc.block_size, salt)
    return (await asyncio.to_thread(hashing) if large else hashing()), None


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
    scheduler.set_params(**locality.policy_params(config.policy))
    placement.set_params(**locality.placement_params(config.placement))
    log.info("locality parameters: %s", locality)


def record_prefix(m: GatewayMetrics, call: Call) -> None:
    """A finished call's prompt, cached and predicted tokens, per backend and per tenant."""
    t = call.tally
    m.add(m.prefix_tokens, (call.backend, "prompt"), t.prompt_tokens)
    m.add(m.prefix_tokens, (call.backend, "cached"), t.cached_tokens)
    if call.predicted_cached_tokens is not None:
        m.add(m.prefix_tokens, (call.backend, "predicted"), call.predicted_cached_tokens)
    if call.fairness_key:
        tenant = m.tenant(call.fairness_key)
        m.add(m.tenant_prefix_tokens, (tenant, "prompt"), t.prompt_tokens)
        m.add(m.tenant_prefix_tokens, (tenant, "cached"), t.cached_tokens)


def locality_gauges(m: GatewayMetrics, index: PrefixIndex | None, backends: Sequence[str], scheduler,
                    placement) -> None:
    """The prefix index's size per backend; DLPM's (or D²LPM's) deficits per tenant and backend."""
    if index is not None:
        for b in backends:
            m.prefix_index_blocks.labels(b).set(index.size(b))
    deficits: dict[str, dict[str, float]] = {}
    if dlpm := [part for part in scheduler.parts() if isinstance(part, DLPM)]:
        deficits = {b: {c: q for part in dlpm for c, q in part.deficits(b).items()} for b in backends}
    elif isinstance(q := getattr(placement, "q", None), dict):
        for client, per_backend in q.items():
            for backend, value in per_backend.items():
                deficits.setdefault(backend, {})[client] = value
    for backend, per_client in deficits.items():
        for client, value in per_client.items():
            if math.isfinite(value):
                m.tenant_deficit.labels(m.tenant(client), backend).set(value)
