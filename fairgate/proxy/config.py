"""Gateway configuration: embedded defaults, a YAML file, environment variables, then command-line flags."""

from __future__ import annotations

from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import hashlib
import logging
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import yaml

from fairgate.engine.vllm_engine import ADMISSIONS
from fairgate.storage.db import DEFAULT_DATABASE_URL, data_dir
from fairgate.storage.redis_client import RedisURLError, check_url

log = logging.getLogger("fairgate.config")

POLICIES = ("fcfs", "rpm", "lcf", "vtc", "vtc-predict", "wsc", "fairserve", "lpm", "dlpm")
PLACEMENTS = ("round-robin", "least-load", "client-round-robin", "power-of-two", "prefix", "d2lpm", "aladdin")
LOCAL_POLICIES, LOCAL_PLACEMENTS = ("lpm", "dlpm"), ("prefix", "d2lpm")  # they read the prefix index


class ConfigError(ValueError):
    pass


@dataclass
class BackendConfig:
    url: str
    name: str | None = None
    models: list[str] | None = None  # None: discovered from the backend's /v1/models
    kv_tokens: int | None = None  # None: read from vllm:cache_config_info
    max_num_seqs: int | None = None
    kv_events: str | None = None  # the ZMQ endpoint of its KV events (vLLM --kv-events-config), for index: precise


@dataclass
class EmulatedConfig:
    count: int = 2
    model: str = "sim-llama"
    profile: str = "a10g-llama2-7b"
    speed: float = 1.0
    kv_tokens: int | None = None
    max_num_seqs: int | None = None
    mean_output: int = 128
    admission: str = "future"  # future: no preemption, every future reserved; vllm: as vLLM v1 (preempts)


@dataclass
class FairServeSettings:
    """WSC, OIT and the app statistics (docs/policies/fairserve.md#parameters). α, β, γ, the user limit and
    the overload thresholds can be changed at run time with `fairgate admin fairserve set` (SQL settings
    ``fairserve.*``)."""

    alpha: float = 1.0  # input tokens
    beta: float = 2.0  # system-prompt tokens
    gamma: float = 1.0  # output tokens
    charge: str = "admit"  # admit | finish (the paper's: nothing until the call ends)
    window_s: float = 60.0  # OIT's sliding window
    user_rpm: int | None = None  # T_user for users without a limit of their own (None: rpm_limit)
    interaction_ttl_s: float = 300.0  # an interaction idle this long is abandoned
    # an interaction's calls (per replica) that count as continuations — served first, never throttled —, at
    # most: twice what 99 % of its app's interactions make (at least 4), this while the app's statistics do not
    # say; past them its calls are ordinary, so a flood tagged with one interaction id buys no more
    max_interaction_calls: int = 32
    kv_threshold: float = 0.9  # overload: committed KV tokens / capacity, pool-wide
    queue_threshold: int = 1  # overload: requests waiting in the gateway for headroom
    statistic: str = "mean"  # mean | median | p90 | p95 | p99 | max
    half_life_s: float = 86_400.0  # of the statistics' forward decay
    min_samples: int = 5  # below this, fall back to the app, then to all traffic
    max_stages_per_app: int = 16  # stage statistics kept per app (the least used dropped past this)
    snapshot_s: float = 10.0  # how often the statistics are written to SQL (and synced through Redis)


LOCALITY_SETTINGS = ("quantum", "client_quantum", "window", "ratio", "gamma", "theta", "pack")  # `fairgate admin
# locality set`, live


def locality_error(name: str, value: float) -> str | None:
    """Why ``value`` cannot be the locality parameter ``name`` (None: it can)."""
    if name == "quantum" and not value > 0:
        return "--quantum (Q^u) must be positive"
    if name == "client_quantum" and not (value > 0 and math.isfinite(value)):
        return "--client-quantum (Q^w) must be positive and finite (Thm A.5)"
    if name == "window" and not (value >= 1 and float(value).is_integer()):
        return "--window must be a whole number ≥ 1"
    if name == "ratio" and not 0 <= value <= 1:
        return "--ratio is a fraction in [0, 1]"
    if name == "gamma" and not 0 <= value <= 1:
        return "--gamma (aladdin's weight of a predicted output in the ATGT budget) is a fraction in [0, 1]"
    if name == "theta" and not 0 < value <= 10:
        return "--theta (aladdin's share of its budgets used) is in (0, 10]"
    if name == "pack" and value not in (0, 1):
        return "--pack is 0 (the least full feasible backend) or 1 (the paper's best fit)"
    return None


@dataclass
class LocalityConfig:
    """DLPM's and D²LPM's parameters (DLPM paper, Table 1) and the approximate prefix index's."""

    quantum: float = 4000.0  # Q^u, DLPM's quantum per client (and per backend)
    window: int = 32  # a client's waiting requests DLPM compares (in arrival order)
    client_quantum: float = 20_000.0  # Q^w, D²LPM's quantum per client × backend
    ratio: float = 0.5  # `prefix` placement: exploit a match longer than this share of the prompt
    gamma: float = 0.5  # `aladdin`: the weight of a request's predicted output in the ATGT budget (Eq. 4)
    theta: float = 0.9  # `aladdin`: the share of the ATGT budget and decode slack a backend may use
    pack: float = 0.0  # `aladdin`: 1 for the paper's best fit, 0 for the least full feasible backend
    block_size: int = 16  # the backends' KV block size (vLLM's default)
    index_ttl_s: float = 600.0  # a block not dispatched for this long is taken as evicted
    index: str = "approximate"  # approximate (learned from dispatches) | precise (the backends' KV events)
    tokenize: str = "gateway"  # prompt blocks from the gateway's tokenizer | backend: the model's, via /tokenize

    def policy_params(self, policy: str) -> dict[str, float]:
        return {"dlpm": {"quantum": self.quantum, "window": self.window}, "lpm": {"window": self.window}}.get(
            policy, {})

    def placement_params(self, placement: str) -> dict[str, float]:
        return {"d2lpm": {"client_quantum": self.client_quantum}, "prefix": {"ratio": self.ratio},
                "aladdin": {"gamma": self.gamma, "theta": self.theta, "pack": self.pack}}.get(placement, {})


@dataclass
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    policy: str = "vtc"  # fair out of the box; fcfs is an explicit choice
    placement: str = "least-load"
    fairness_key: str = "user"  # user | app | key | app>user (apps by weight, then users within each app)
    cache_salt: str = "app"  # vLLM prefix-cache isolation: app | user | shared (no salt: all tenants share)
    backends: list[BackendConfig] = field(default_factory=list)  # empty: start `emulated` in-process
    emulated: EmulatedConfig = field(default_factory=EmulatedConfig)
    locality: LocalityConfig = field(default_factory=LocalityConfig)
    database_url: str = DEFAULT_DATABASE_URL
    # counters, backlog and in-flight shared with other replicas: redis://host:port/db (one server) or
    # redis+cluster://host:port[,host:port…] (Redis Cluster)
    redis_url: str | None = None
    redis_namespace: str = "fairgate"  # replicas with the same namespace share state
    # how often a replica syncs with the others through Redis (counters, backlogs, KV budgets): a shorter interval
    # hands KV one replica frees to another sooner, and costs Redis more (docs/operations/replicas.md#cost)
    redis_sync_s: float = 0.02
    max_body_bytes: int = 8 * 1024 * 1024
    tokenizer: str = "cl100k_base"
    tokenizers: dict[str, str] = field(default_factory=dict)  # model → tiktoken encoding
    # an image, audio or video part of a chat message, counted before its backend reports the prompt's count (a
    # vision model's placeholders depend on the model and the picture); the limits reserve from it
    prompt_media_tokens: int = 2048
    health_interval_s: float = 2.0
    connect_timeout_s: float = 5.0
    first_token_timeout_s: float = 600.0  # dispatch → first event (prefill of a long prompt on a busy backend)
    idle_timeout_s: float = 120.0  # between two events of a stream, after the first
    request_timeout_s: float = 3600.0  # dispatch → last event
    write_timeout_s: float = 60.0  # a client that reads nothing this long is dropped (its backend aborted)
    max_event_bytes: int = 16 * 1024 * 1024  # one upstream SSE line (or a whole non-streamed answer)
    # the Responses API's stored responses (docs/guide/responses.md): how long one can be read or continued,
    # the most turns and bytes of input and output items a previous_response_id chain may hold, and the most
    # bytes one app's stored responses may take (past it, a request that would store another is refused)
    response_retention_s: float = 30 * 86400
    response_max_turns: int = 256
    response_max_chain_bytes: int = 16 * 1024 * 1024
    response_max_app_bytes: int = 1024 * 1024 * 1024
    # a non-streaming client's request goes upstream as "json" (one answer: cheapest; a client that leaves
    # before it is billed its reserved max_tokens, the count being lost with the connection) or "stream"
    # (running usage on every chunk: a client that leaves is billed exactly what was generated)
    nonstream_upstream: str = "json"
    max_attempts: int = 3  # backends tried before the first token
    outlier_consecutive_failures: int = 3  # failures before the first token in a row that eject a backend
    outlier_ejection_s: float = 10.0  # × the backend's consecutive ejections (≤ 10×)
    retry_after_s: int = 1
    identity_cache_ttl_s: float = 5.0
    cost: str = "weighted"  # tokens | weighted | profile: what a token costs in the fair queue
    rpm_limit: int = 60  # the rpm policy's limit when a user or app has none of its own
    budget_timezone: str = "UTC"  # where a budget's day, week (from Monday) and month begin (an IANA zone)
    budget_overdraw: float = 0.05  # the share of a budget an interaction's continuation may go over by
    gate_overcommit: float = 1.0  # fraction of a backend's KV capacity the gate may reserve
    # the KV the gate reserves for a streamed request's output: "predicted", the reserve_quantile of the output
    # lengths seen for its app, stage and prompt length (accounting/length.py), grown as a stream outlives it;
    # or "max_tokens", all it may generate (also what a whole, non-streamed upstream answer or a kind of request
    # not seen often enough yet holds)
    reserve: str = "predicted"
    reserve_quantile: float = 0.9
    # how the reservations add up on a backend: "future", the most the running requests will hold together at any
    # future decode step (Aladdin's constraint (e)); "peaks", each at its largest at once (docs: #reservation)
    kv_gate: str = "future"
    latency_profile: str = "a10g-llama2-7b"  # the engine profile each backend's latency fit starts from
    max_inflight_per_backend: int = 64  # when a backend's KV capacity is unknown
    queue_timeout_s: float = 600.0
    max_queued: int = 10_000  # requests waiting in one gateway (503 queue_full beyond)
    max_queued_per_tenant: int = 1_000  # requests one fairness key may have waiting (429 tenant_queue_full)
    # requests one app may have waiting, whatever number of users it names (429 app_queue_full): a quarter of the
    # queue, so that no app fills it for the others
    max_queued_per_app: int = 2_500
    # under fairness_key user: the users of one app that wait in the queue as themselves; an app's further users
    # wait as the app (its calls that name no user), sharing its turns: naming users buys at most this many shares
    max_users_per_app: int = 16
    settings_refresh_s: float = 2.0  # how often weights and limits are re-read from SQL
    usage_dead_letter: str = ""  # usage rows the database refused, as JSON lines; "": in data_dir()
    # every row is journaled (``<usage_journal>.<n>``) as its request ends, and kept there until the database
    # holds it: through an outage, a stop and a kill (written at the next start); "": journal_path()
    usage_journal: str = ""
    worker: int = 0  # this process's index under `serve --workers N` (set by the supervisor)
    # the journal fsync'd every this many seconds (what a lost machine may lose), or with every row at 0
    usage_journal_fsync_s: float = 1.0
    usage_flush_at_stop_s: float = 10.0  # at shutdown; what is left then waits in the journal for the next start
    drain_s: float = 30.0  # on SIGTERM: stop accepting, let requests finish this long, then cancel them
    max_connections: int = 10_000  # open client connections on the listener (fairgate.http.server.Limits)
    max_connections_per_client: int = 1_000  # of them, from one client address
    header_timeout_s: float = 30.0  # a request's headers must arrive within this (also the keep-alive idle)
    anonymous_idle_s: float = 5.0  # keep-alive idle of a connection that never carried an authenticated request
    anonymous_rate: float = 50.0  # requests a second such a connection is served (a burst of as many); 0: unpaced
    body_timeout_s: float = 60.0  # a request's body must arrive within this (else 408)
    ops_port: int | None = None  # serve /metrics (and /ready's detail) here only, e.g. on the monitoring network
    ops_host: str = "127.0.0.1"
    ops_token: str | None = None  # else /metrics needs it, and /ready shows backend detail only with it
    metrics_public: bool = False  # /metrics on the public port without the ops token (it names every tenant)
    log_format: str = "text"  # text | json (JSON lines), for every log record
    access_log: bool = True  # one record per request with a valid key, at info on fairgate.access (fairgate/logs.py)
    hash_tenant_labels: bool = False  # per-tenant metrics labelled by a hash of the fairness key, not its name
    fairserve: FairServeSettings = field(default_factory=FairServeSettings)
    # where each key was set (not a setting): load_config fills it, source() reads it
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def source(self, key: str) -> str:
        """Where the configured value of ``key`` (dotted: ``locality.quantum``) comes from."""
        return self.sources.get(key, "default")

    def journal_path(self) -> str:
        """The usage journal: as configured, else one per database and port in ``data_dir()`` (two gateways
        never share one: its lock refuses the second)."""
        if self.usage_journal:
            return f"{self.usage_journal}.w{self.worker}" if self.worker else self.usage_journal
        db = hashlib.sha256(self.database_url.encode()).hexdigest()[:8]
        return str(data_dir() / f"fairgate-usage-journal-{db}-{self.port}{f'-w{self.worker}' if self.worker else ''}")

    def legacy_usage_paths(self) -> list[Path]:
        """Where a version before 2026-11-28d kept rows not yet written: its default spool file and journal
        (``fairgate-usage-spool-…``), and the spool file beside a journal configured from ``usage_spool``
        (storage/usage_journal.py ``adopt`` moves what they hold into the journal)."""
        db = hashlib.sha256(self.database_url.encode()).hexdigest()[:8]
        spool = data_dir() / f"fairgate-usage-spool-{db}-{self.port}{f'-w{self.worker}' if self.worker else ''}.jsonl"
        out = [spool, Path(f"{spool}.journal")]
        if self.usage_journal.endswith(".journal"):
            base = self.usage_journal[:-len(".journal")]
            spool = Path(f"{base}.w{self.worker}" if self.worker else base)
            out += [spool, Path(f"{spool}.journal")]
        return out

    def dead_letter_path(self) -> str:
        return self.usage_dead_letter or str(data_dir() / "fairgate-usage-dead-letter.jsonl")

    def validate(self) -> "GatewayConfig":
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.emulated.admission not in ADMISSIONS:
            raise ConfigError(f"emulated.admission must be one of {', '.join(ADMISSIONS)}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}; known: {', '.join(PLACEMENTS)}")
        for b in self.backends:
            u = urlsplit(b.url)
            if u.scheme not in ("http", "https") or not u.hostname:
                raise ConfigError(f"backend url {b.url!r}: expected http://host[:port] or https://host[:port]")
        if not (type(self.prompt_media_tokens) is int and 0 <= self.prompt_media_tokens <= 1_000_000):
            raise ConfigError("prompt_media_tokens must be an integer within [0, 1000000]")
        if not 0 <= self.usage_journal_fsync_s <= 3600:
            raise ConfigError("usage_journal_fsync_s must be within [0, 3600] seconds")
        if not 0.001 <= self.redis_sync_s <= 10:
            raise ConfigError("redis_sync_s must be within [0.001, 10] seconds")
        if self.redis_url:
            try:
                check_url(self.redis_url)
            except RedisURLError as e:
                raise ConfigError(str(e)) from None
        try:
            ZoneInfo(self.budget_timezone)
        except (ValueError, KeyError, ZoneInfoNotFoundError):
            raise ConfigError(f"budget_timezone {self.budget_timezone!r} is not an IANA time zone") from None
        if not 0 <= self.budget_overdraw <= 1:
            raise ConfigError("budget_overdraw is a share of the budget, in [0, 1]")
        if not (self.response_retention_s > 0 and self.response_max_turns >= 1 and self.response_max_chain_bytes > 0
                and self.response_max_app_bytes > 0):
            raise ConfigError("response_retention_s > 0, response_max_turns ≥ 1, response_max_chain_bytes > 0, "
                              "response_max_app_bytes > 0")
        if self.cache_salt not in ("app", "user", "shared"):
            raise ConfigError("cache_salt must be app, user or shared")
        loc = self.locality
        if not (loc.quantum > 0 and loc.client_quantum > 0 and loc.client_quantum != float("inf")
                and loc.window >= 1 and loc.block_size >= 1 and 0 <= loc.ratio <= 1):
            raise ConfigError("locality: quantum > 0, finite client_quantum > 0, window ≥ 1, block_size ≥ 1, "
                              "0 ≤ ratio ≤ 1")
        for name in ("gamma", "theta", "pack"):
            if (why := locality_error(name, float(getattr(loc, name)))) is not None:
                raise ConfigError("locality: " + why.replace("--", ""))
        if loc.index not in ("approximate", "precise"):
            raise ConfigError("locality.index must be approximate or precise")
        if loc.tokenize not in ("gateway", "backend"):
            raise ConfigError("locality.tokenize must be gateway or backend")
        if loc.index == "precise" and self.backends and not all(b.kv_events for b in self.backends):
            raise ConfigError("locality.index: precise needs every backend's kv_events endpoint (vLLM's "
                              "--kv-events-config publisher)")
        if self.log_format not in ("text", "json"):
            raise ConfigError("log_format must be text or json")
        if self.max_users_per_app < 1:
            raise ConfigError("max_users_per_app must be at least 1")
        if self.fairness_key not in ("user", "app", "key", "app>user"):
            raise ConfigError("fairness_key must be user, app, key or app>user")
        if self.cost not in ("tokens", "weighted", "profile"):
            raise ConfigError("cost must be tokens, weighted or profile")
        from fairgate.engine.profiles import PROFILES

        if self.latency_profile not in PROFILES:
            raise ConfigError(f"latency_profile is one of {', '.join(sorted(PROFILES))}")
        if self.reserve not in ("predicted", "max_tokens"):
            raise ConfigError("reserve must be predicted or max_tokens")
        if not 0.5 <= self.reserve_quantile <= 1.0:
            raise ConfigError("reserve_quantile must be between 0.5 and 1")
        if self.kv_gate not in ("future", "peaks"):
            raise ConfigError("kv_gate must be future or peaks")
        if self.nonstream_upstream not in ("json", "stream"):
            raise ConfigError("nonstream_upstream must be json or stream")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts must be at least 1")
        fs = self.fairserve
        if fs.charge not in ("admit", "finish"):
            raise ConfigError("fairserve.charge must be admit or finish")
        if not (type(fs.max_interaction_calls) is int and fs.max_interaction_calls >= 1):
            raise ConfigError("fairserve.max_interaction_calls must be an integer ≥ 1")
        if fs.statistic not in ("mean", "median", "p90", "p95", "p99", "max"):
            raise ConfigError("fairserve.statistic must be mean, median, p90, p95, p99 or max")
        if min(fs.alpha, fs.beta, fs.gamma) < 0 or fs.alpha + fs.beta + fs.gamma <= 0:
            raise ConfigError("fairserve.alpha, beta, gamma must be ≥ 0 and not all 0")
        return self

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _build(cls, data: dict[str, Any], where: str):
    known = {f.name for f in fields(cls)} - {"sources"}
    unknown = set(data) - known
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**data)


# keys of earlier versions: the key each became (and how its value reads as that key), or None (ignored)
RENAMED: dict[str, tuple[str, Callable[[Any], Any]] | None] = {
    "usage_spool": ("usage_journal", lambda spool: f"{spool}.journal" if spool else ""),  # (its journal's place)
    "usage_spool_max_bytes": None,
}

ENVIRONMENT = (("FAIRGATE_DATABASE_URL", "database_url"), ("FAIRGATE_REDIS_URL", "redis_url"),
               ("FAIRGATE_POLICY", "policy"), ("FAIRGATE_OPS_TOKEN", "ops_token"),
               ("FAIRGATE_LOG_FORMAT", "log_format"))


def load_config(path: str | None = None, **overrides: Any) -> GatewayConfig:
    """Defaults ← YAML file (``path`` or $FAIRGATE_CONFIG) ← environment ← non-None ``overrides`` (flags).
    The running gateways then take the live settings an admin stored in the database over all of these
    (``fairgate admin policy set``; ``… unset`` hands a setting back). ``sources`` says where each key came
    from: ``file PATH``, ``environment VAR`` or ``flag`` (absent: the default)."""
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = path or os.environ.get("FAIRGATE_CONFIG")
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        for k, v in data.items():
            nested = k in ("fairserve", "locality", "emulated") and isinstance(v, dict)
            sources.update(dict.fromkeys([f"{k}.{sub}" for sub in v] if nested else [str(k)], f"file {path}"))
    for env, key in ENVIRONMENT:
        if os.environ.get(env):
            data[key], sources[key] = os.environ[env], f"environment {env}"
    flags = {k: v for k, v in overrides.items() if v is not None}
    data.update(flags)
    sources.update(dict.fromkeys(flags, "flag"))
    for old, new in RENAMED.items():  # a key of an earlier version, as what it became
        if old in data:
            value = data.pop(old)
            if new is not None and new[0] not in data:
                data[new[0]], sources[new[0]] = new[1](value), sources.pop(old, "file")
            log.warning("config: `%s` is obsolete%s", old, f"; read as `{new[0]}`" if new else " and ignored")
    backends = [b if isinstance(b, BackendConfig) else
                _build(BackendConfig, {"url": b} if isinstance(b, str) else b, "backends")
                for b in data.pop("backends", None) or []]
    emulated = data.pop("emulated", None) or {}
    if not isinstance(emulated, EmulatedConfig):
        emulated = _build(EmulatedConfig, emulated, "emulated")
    fairserve = data.pop("fairserve", None) or {}
    if not isinstance(fairserve, FairServeSettings):
        fairserve = _build(FairServeSettings, fairserve, "fairserve")
    locality = data.pop("locality", None) or {}
    if not isinstance(locality, LocalityConfig):
        locality = _build(LocalityConfig, locality, "locality")
    cfg = _build(GatewayConfig, {**data, "backends": backends, "emulated": emulated, "fairserve": fairserve,
                                 "locality": locality}, "config").validate()
    cfg.sources = sources
    return cfg
