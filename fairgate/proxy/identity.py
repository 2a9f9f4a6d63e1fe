"""Who is calling: key → app and user (cached briefly), the end user an app key names, and the interaction."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web
from sqlalchemy.ext.asyncio import async_sessionmaker

from fairgate.proxy.errors import APIError
from fairgate.storage.identity import KeyIdentity, lookup_key

INTERACTION_HEADER = "X-Fairgate-Interaction"
STAGE_HEADER = "X-Fairgate-Stage"
USER_HEADER = "X-Fairgate-User"


@dataclass(frozen=True, slots=True)
class Caller:
    key: KeyIdentity
    user: str | None
    interaction: str
    stage: int

    @property
    def app(self) -> str:
        return self.key.app

    def fairness_key(self, mode: str) -> str:
        if mode == "app":
            return f"app:{self.key.app}"
        if mode == "key":
            return f"key:{self.key.key_id}"
        return f"user:{self.user}" if self.user else f"app:{self.key.app}"


class KeyCache:
    """Key lookups cached for ``ttl_s`` (negative answers too), so the hot path rarely touches SQL."""

    def __init__(self, sessions: async_sessionmaker, ttl_s: float = 5.0, size: int = 10_000):
        self.sessions, self.ttl_s, self.size = sessions, ttl_s, size
        self._cache: OrderedDict[str, tuple[float, KeyIdentity | None]] = OrderedDict()

    async def get(self, key: str) -> KeyIdentity | None:
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit and now - hit[0] < self.ttl_s:
            return hit[1]
        async with self.sessions() as s:
            ident = await lookup_key(s, key)
        self._cache[key] = (now, ident)
        self._cache.move_to_end(key)
        while len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return ident


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


def bearer(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
    return token.strip()


async def authenticate(request: web.Request, keys: KeyCache) -> KeyIdentity:
    ident = await keys.get(bearer(request))
    if ident is None:
        raise APIError(401, "invalid or disabled API key", code="invalid_api_key")
    return ident


def resolve(request: web.Request, key: KeyIdentity, body_user: str | None, request_id: str,
            stages: StageCounter) -> Caller:
    claimed = request.headers.get(USER_HEADER) or body_user
    if key.user is not None:
        if claimed and claimed != key.user:
            raise APIError(403, f"this key belongs to user {key.user!r} and may not act for {claimed!r}",
                           param="user", code="user_mismatch")
        user = key.user
    else:
        user = claimed or None
    interaction = request.headers.get(INTERACTION_HEADER)
    raw_stage = request.headers.get(STAGE_HEADER)
    if raw_stage is not None:
        if not raw_stage.isdigit():
            raise APIError(400, f"{STAGE_HEADER} must be a non-negative integer", param=STAGE_HEADER)
        stage = int(raw_stage)
    else:
        stage = stages.next(f"{key.app}/{interaction}") if interaction else 0
    return Caller(key, user, interaction or request_id, stage)
