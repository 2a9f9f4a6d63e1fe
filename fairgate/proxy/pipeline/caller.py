"""Who is calling: key → app and user (cached briefly), the end user an app key names, and the interaction.

Every name a client sends is bounded here, before it reaches a scheduler, Redis or SQL: user and interaction
ids are 1-128 printable characters, the stage a small integer. The interaction a policy sees is scoped to
(app, user): a call that repeats another tenant's interaction id does not continue it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.http.messages import Request
from fairgate.proxy.errors import APIError
from fairgate.storage.identity import KeyIdentity, lookup_key, user_key

log = logging.getLogger("fairgate.identity")
INTERACTION_HEADER = "X-Fairgate-Interaction"
STAGE_HEADER = "X-Fairgate-Stage"
USER_HEADER = "X-Fairgate-User"
MAX_ID = 128  # user and interaction ids: 1-128 printable characters (str.isprintable: no control, format —
# bidi overrides, zero-width — or line and paragraph separators, which would reach logs and metric labels raw)
MAX_KEY = 256  # bytes of a bearer token: a longer one is no key of ours, and is never looked up or cached
MAX_STAGE = 63  # stages an interaction may name (a call past the last counted stage shares it)


def scope(app: str, user: str | None, interaction: str) -> str:
    """An interaction id within its (app, user); length-prefixed, so no choice of names can collide."""
    return f"{len(app)}:{app}/{len(user or '')}:{user or ''}/{interaction}"


@dataclass(frozen=True, slots=True)
class Caller:
    key: KeyIdentity
    user: str | None
    interaction: str  # as the client named it (the usage row's), or the request's own id
    stage: int
    named_interaction: bool = False  # the client sent X-Fairgate-Interaction
    user_shared: bool = False  # the user is one an admin shared among apps, not this app's own

    @property
    def app(self) -> str:
        return self.key.app

    @property
    def scoped_interaction(self) -> str:
        """The interaction as policies and shared state key it: only its own (app, user) can continue it."""
        return scope(self.app, self.user, self.interaction) if self.named_interaction else self.interaction

    def fairness_key(self, mode: str) -> str:
        """``user`` (and ``app>user``, whose policy also reads the app): the user within its app (a shared
        user across apps), or the app for calls that name no user; ``app``; ``key``."""
        if mode == "app":
            return f"app:{self.key.app}"
        if mode == "key":
            return f"key:{self.key.key_id}"
        return f"user:{user_key(self.app, self.user, self.user_shared)}" if self.user else f"app:{self.key.app}"


class KeyCache:
    """Key lookups cached for ``ttl_s`` (negative answers too), so the hot path rarely touches SQL. While the
    database cannot answer, a key seen before keeps working on its last answer, however old, and an unknown
    key gets a 503 with retry-after: a database outage never takes the data plane down.

    One lookup per key at a time: concurrent requests with a key not yet cached wait for the same lookup, and
    a key whose answer has expired is answered from it while one lookup refreshes it in the background (a
    revoked key stops working within ``ttl_s`` + one lookup). Without this, every expiry sent all in-flight
    requests of a busy key to SQL at once, and they queued on it for hundreds of milliseconds.

    Unknown keys are remembered apart from known ones (``size`` each, least recently used out), so a flood of
    made-up keys never evicts a tenant's; a key is at most ``MAX_KEY`` bytes (``authenticate``)."""

    def __init__(self, sessions: async_sessionmaker, ttl_s: float = 5.0, size: int = 10_000):
        self.sessions, self.ttl_s, self.size = sessions, ttl_s, size
        self._cache: OrderedDict[str, tuple[float, KeyIdentity | None]] = OrderedDict()  # known keys
        self._misses: OrderedDict[str, tuple[float, KeyIdentity | None]] = OrderedDict()  # unknown or disabled
        self._pending: dict[str, asyncio.Future] = {}
        self._refreshing: set[asyncio.Task] = set()
        self.stale_answers = 0  # lookups answered from the cache because the database failed

    async def get(self, key: str) -> KeyIdentity | None:
        now = time.monotonic()
        hit = self._cache.get(key) or self._misses.get(key)
        if hit is not None:
            if now - hit[0] >= self.ttl_s and key not in self._pending:
                task = asyncio.ensure_future(self._lookup(key, hit))
                self._refreshing.add(task)
                task.add_done_callback(self._refreshed)
            return hit[1]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        return await self._lookup(key, None)

    def _refreshed(self, task: asyncio.Task) -> None:
        self._refreshing.discard(task)
        if not task.cancelled():
            task.exception()  # a failed refresh keeps the old answer; nothing to report twice

    async def _lookup(self, key: str, hit) -> KeyIdentity | None:
        fut = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        try:
            try:
                async with self.sessions() as s:
                    ident = await lookup_key(s, key)
            except Exception as e:
                if hit is not None:
                    self.stale_answers += 1
                    ident = hit[1]
                    fut.set_result(ident)
                    return ident
                log.warning("key lookup failed (%s): unknown keys get 503 until the database answers", e)
                err = APIError(503, "the gateway cannot check this key right now; retry shortly",
                               type="server_error", code="identity_unavailable",
                               headers={"retry-after": "1", "x-should-retry": "true"})
                fut.set_exception(err)
                fut.exception()  # retrieved: waiters re-raise it
                raise err from None
            table, other = (self._cache, self._misses) if ident is not None else (self._misses, self._cache)
            other.pop(key, None)
            table[key] = (time.monotonic(), ident)
            table.move_to_end(key)
            while len(table) > self.size:
                table.popitem(last=False)
            fut.set_result(ident)
            return ident
        except BaseException as e:  # cancelled: waiters must not hang
            if not fut.done():
                fut.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
                fut.exception()
            raise
        finally:
            if self._pending.get(key) is fut:
                del self._pending[key]


class StageCounter:
    """Counts calls per interaction when the client does not say which stage a call is (bounded LRU)."""

    def __init__(self, size: int = 100_000):
        self.size = size
        self._seen: OrderedDict[str, int] = OrderedDict()

    def next(self, interaction: str) -> int:
        stage = self._seen.get(interaction, -1) + 1
        self._seen[interaction] = stage
        self._seen.move_to_end(interaction)
        if len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return stage


def bearer(request: Request) -> str:
    """The key: ``Authorization: Bearer <key>``, or Anthropic's clients' ``x-api-key: <key>``."""
    auth = request.headers.get("Authorization")
    if auth is None and (key := request.headers.get("x-api-key")) is not None and key.strip():
        return key.strip()
    scheme, _, token = (auth or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    return token.strip()


async def authenticate(request: Request, keys: KeyCache) -> KeyIdentity:
    token = bearer(request)
    if len(token) > MAX_KEY or not token.isascii():
        raise APIError(401, "invalid or disabled API key", code="invalid_api_key")
    ident = await keys.get(token)
    if ident is None:
        raise APIError(401, "invalid or disabled API key", code="invalid_api_key")
    return ident


def _name(value: str | None, what: str, param: str) -> str | None:
    if value is None:
        return None
    if not (0 < len(value) <= MAX_ID and value.isprintable()):
        raise APIError(400, f"{what} must be 1-128 printable characters", param=param, code="invalid_value")
    return value


def resolve(request: Request, key: KeyIdentity, body_user: str | None, request_id: str,
            stages: StageCounter, is_shared: Callable[[str, str], bool] = lambda _app, _name: False) -> Caller:
    """Who the call is for. An app key names users of its own app only (the same name in another app is
    another user); a name an admin shared among apps (``is_shared``) is that shared user."""
    header_user = request.headers.get(USER_HEADER)
    claimed = _name(header_user, USER_HEADER, USER_HEADER) if header_user is not None else \
        _name(body_user, "'user' (or 'safety_identifier')", "user")
    if header_user is not None and body_user is not None and body_user != header_user:
        # the backend would see the body's user, the fair queue and the usage row the header's: refuse either
        raise APIError(400, f"{USER_HEADER} and the body's 'user' name different users", param="user",
                       code="user_mismatch")
    if key.user is not None:
        if claimed and claimed != key.user:
            raise APIError(403, f"this key belongs to user {key.user!r} and may not act for {claimed!r}",
                           param="user", code="user_mismatch")
        user, shared = key.user, key.user_shared
    else:
        user = claimed or None
        shared = user is not None and is_shared(key.app, user)
    interaction = _name(request.headers.get(INTERACTION_HEADER), INTERACTION_HEADER, INTERACTION_HEADER)
    raw_stage = request.headers.get(STAGE_HEADER)
    if raw_stage is not None:
        if not (raw_stage.isascii() and raw_stage.isdigit() and len(raw_stage) <= 2
                and int(raw_stage) <= MAX_STAGE):
            raise APIError(400, f"{STAGE_HEADER} must be an integer from 0 to {MAX_STAGE}", param=STAGE_HEADER,
                           code="invalid_value")
        stage = int(raw_stage)
    else:
        counted = stages.next(scope(key.app, user, interaction)) if interaction else 0
        stage = min(counted, MAX_STAGE)
    return Caller(key, user, interaction or request_id, stage, interaction is not None, shared)
