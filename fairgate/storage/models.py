"""SQL schema: identity (apps, users, keys, weights, limits), the admin audit, and the per-request usage log."""

from __future__ import annotations

from datetime import datetime, timezone
from enum import StrEnum

from sqlalchemy import (BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, TypeDecorator,
                        UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# vLLM body fields that reach a backend only for an app an admin allowed (``fairgate admin app allow``):
# they change how a request runs or is named, beyond what sampling parameters do
GUARDED_FIELDS = frozenset((
    "chat_template", "chat_template_kwargs", "kv_transfer_params", "priority", "mm_processor_kwargs",
    "logits_processors", "vllm_xargs", "request_id", "remote_media"))


class Status(StrEnum):
    """How a request ended: its usage row's ``status``. Every row has exactly one, so the counts of a
    ``fairgate usage summary`` add up to its requests."""

    OK = "ok"  # answered (a stream ended with [DONE])
    ERROR = "error"  # a backend or the gateway failed it
    CANCELLED = "cancelled"  # the client went away
    THROTTLED = "throttled"  # refused for load or a limit (429)
    REJECTED = "rejected"  # refused as invalid (another 4xx)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class App(Base):
    __tablename__ = "apps"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    rpm_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class User(Base):
    """An end user of one app (the same name in two apps is two users), or, with no app, a user that an admin
    shares explicitly among every app (unique by name among shared users; checked by the admin code)."""

    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("app_id", "name", name="uq_users_app_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    app_id: Mapped[int | None] = mapped_column(ForeignKey("apps.id"), nullable=True)
    name: Mapped[str] = mapped_column(String(256))
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    rpm_limit: Mapped[int | None] = mapped_column(Integer, nullable=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiKey(Base):
    __tablename__ = "api_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex; the key itself is never stored
    prefix: Mapped[str] = mapped_column(String(16))  # first characters, to recognise a key in listings
    name: Mapped[str | None] = mapped_column(String(128), nullable=True)
    app_id: Mapped[int] = mapped_column(ForeignKey("apps.id"))
    user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id"), nullable=True)
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Quota(Base):
    """Token and concurrency limits and budgets of one app, user or key (``target``: ``app:A``, ``user:A/U``
    (``user:U`` for a shared user), ``key:ID``), set with `fairgate admin limit|budget set`
    (docs/operations/limits.md). An app's or a user's request limit is its row's ``rpm_limit`` (FairServe's OIT
    reads it too); a key's is here."""

    __tablename__ = "quotas"
    target: Mapped[str] = mapped_column(String(400), primary_key=True)
    rpm: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # keys only
    tpm: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tpm_kind: Mapped[str] = mapped_column(String(16), default="total")  # total | input | output | weighted
    concurrency: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    budget_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    budget_usd: Mapped[float | None] = mapped_column(Float, nullable=True)
    budget_period: Mapped[str] = mapped_column(String(8), default="month")  # day | week | month | total
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Price(Base):
    """What a model's tokens cost, in USD per million (`fairgate admin price set`): budgets in money, and
    `fairgate usage spend`."""

    __tablename__ = "prices"
    model: Mapped[str] = mapped_column(String(256), primary_key=True)
    input: Mapped[float] = mapped_column(Float)
    output: Mapped[float] = mapped_column(Float)
    cached: Mapped[float | None] = mapped_column(Float, nullable=True)  # cached input (None: as input)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class Setting(Base):
    """Gateway-wide settings changed at run time (the active policy); replicas poll them."""

    __tablename__ = "settings"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class AdminAudit(Base):
    __tablename__ = "admin_audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(256))
    before: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    after: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON


class UsageLog(Base):
    """One row per request that reached the gateway with a valid key, whatever became of it."""

    __tablename__ = "usage_log"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), index=True, unique=True)  # the gateway's own
    client_request_id: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # x-request-id
    user: Mapped[str | None] = mapped_column(String(256), nullable=True)
    app: Mapped[str] = mapped_column(String(128))
    key_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    interaction: Mapped[str] = mapped_column(String(256))
    stage: Mapped[int] = mapped_column(Integer, default=0)
    endpoint: Mapped[str] = mapped_column(String(32))
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    backend: Mapped[str | None] = mapped_column(String(256), nullable=True)
    stream: Mapped[bool] = mapped_column(Boolean, default=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    system_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)  # the backend's report
    predicted_cached_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the prefix index's
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # of completion_tokens
    estimated_prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)  # the gateway's count before dispatch
    arrival: Mapped[datetime] = mapped_column(UTCDateTime)
    dispatched_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime, nullable=True)
    status: Mapped[str] = mapped_column(String(16))  # ok | error | cancelled | throttled | rejected
    http_status: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    throttle_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)  # backends tried
    client_retry: Mapped[int] = mapped_column(Integer, default=0)  # x-stainless-retry-count
    fairness_key: Mapped[str | None] = mapped_column(String(300), nullable=True)  # the policy's "client"
    policy: Mapped[str | None] = mapped_column(String(32), nullable=True)
    queue_wait_ms: Mapped[float | None] = mapped_column(Float, nullable=True)  # in the gateway's fair queue
    counter_before: Mapped[float | None] = mapped_column(Float, nullable=True)  # the client's virtual counter
    counter_after: Mapped[float | None] = mapped_column(Float, nullable=True)
    slo_class: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the app's (admin slo set)
    slo_ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)  # this request's targets
    slo_atgt_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    atgt_ms: Mapped[float | None] = mapped_column(Float, nullable=True)  # observed: decode time / (tokens − 1)
    slo_met: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # None: no class
    predicted_ttft_ms: Mapped[float | None] = mapped_column(Float, nullable=True)  # its calibrated p90 at admission

    __table_args__ = (
        Index("ix_usage_arrival", "arrival"),
        Index("ix_usage_user_arrival", "user", "arrival"),
        Index("ix_usage_app_arrival", "app", "arrival"),
        Index("ix_usage_interaction", "interaction"),
    )


class AppTokenStats(Base):
    """The snapshot of the per-(app, stage) token statistics (FairServe's N̄), so a restarted fleet does not
    start blind. ``stage`` −1 is the app over all stages; app "" is all traffic. ``state`` holds the decayed
    sums and histograms (JSON); the mean columns are there for humans querying SQL."""

    __tablename__ = "app_token_stats"
    app: Mapped[str] = mapped_column(String(128), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    mean_input: Mapped[float] = mapped_column(Float, default=0.0)
    mean_system: Mapped[float] = mapped_column(Float, default=0.0)
    mean_output: Mapped[float] = mapped_column(Float, default=0.0)
    landmark: Mapped[float] = mapped_column(Float, default=0.0)  # forward decay's landmark (unix seconds)
    state: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)


class StoredResponse(Base):
    """A response of the Responses API stored by the gateway (``store``, OpenAI's default): this turn's own
    input and output items, the response object as answered, and where it sits in its chain. Scoped to the app
    and user that made it (``user`` "" for none); read only until ``expires_at`` (the retention an admin sets)."""

    __tablename__ = "stored_responses"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # resp_ and 48 random hex digits
    app: Mapped[str] = mapped_column(String(128))
    user: Mapped[str] = mapped_column(String(256))
    previous_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    interaction: Mapped[str] = mapped_column(String(256))  # the chain's, from its first turn
    turn: Mapped[int] = mapped_column(Integer)  # 1 for a response without a previous one
    chain_bytes: Mapped[int] = mapped_column(Integer)  # the items of the whole chain up to this turn
    backend: Mapped[str | None] = mapped_column(String(256), nullable=True)  # what served it (its prefix is there)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime, index=True)
    input_items: Mapped[str] = mapped_column(Text)  # JSON
    output_items: Mapped[str] = mapped_column(Text)  # JSON
    response: Mapped[str] = mapped_column(Text)  # JSON: the response object as the client got it
    size_bytes: Mapped[int] = mapped_column(Integer, default=0)  # its three JSON texts, counted to its app


class StoredResponseBytes(Base):
    """What an app's stored responses take (their ``size_bytes``), kept in the transaction that stores or forgets
    one: checked against ``response_max_app_bytes`` before a request that would store another."""

    __tablename__ = "stored_response_bytes"
    app: Mapped[str] = mapped_column(String(128), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
