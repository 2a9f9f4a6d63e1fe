"""The Responses API's stored responses, in the gateway's database: each turn's own input and output items, so a
follow-up naming ``previous_response_id`` is expanded into the whole conversation before it queues, and any
backend behind any replica serves it. Scoped to the app and user that made a response: another tenant's id, an
unknown one and one past retention are the same "not found". A chain is read with one recursive query, bounded
by the turns it may have.

What each app's stored responses take is kept beside them (``stored_response_bytes``), in the transaction that
stores or forgets one, so it is exact across replicas. A replica reads every app's total at each ``refresh`` and
learns its own apps' new totals as it commits: an app is refused more storage once its total reached its cap
(``over_cap``), late by at most what the other replicas stored for it since the last refresh, and by the
requests under way.
"""

from __future__ import annotations

import asyncio
import secrets
import sqlite3
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import bindparam, delete, insert, literal, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from fairgate.storage.models import StoredResponse, StoredResponseBytes


def new_response_id() -> str:
    """``resp_`` and 48 random hex digits: unguessable."""
    return "resp_" + secrets.token_hex(24)


@dataclass(slots=True)
class Turn:
    """A stored response as a chain reads it."""

    id: str
    interaction: str
    turn: int
    chain_bytes: int
    backend: str | None
    input_items: list[Any]
    output_items: list[Any]


class ChainTooLong(Exception):
    pass


class StoreUnavailable(Exception):
    """The database did not answer a read or a deletion of stored responses."""


def _unavailable(method):
    """A database error of a read or a deletion as ``StoreUnavailable`` (the gateway answers it with a 503)."""
    async def guarded(*args, **kwargs):
        try:
            return await method(*args, **kwargs)
        except (SQLAlchemyError, OSError) as e:
            raise StoreUnavailable(f"{type(e).__name__}: {str(e)[:200]}") from e
    return guarded


class ResponseStore:
    def __init__(self, engine: AsyncEngine, retention_s: float, max_turns: int):
        if engine.dialect.name == "sqlite" and sqlite3.sqlite_version_info < (3, 35):  # (RETURNING)
            raise RuntimeError(f"SQLite {sqlite3.sqlite_version} is too old for stored responses: 3.35 or later "
                               "is needed (or PostgreSQL)")
        self.engine, self.sessions = engine, async_sessionmaker(engine, expire_on_commit=False)
        # reads on PostgreSQL without BEGIN and ROLLBACK: two round trips fewer (SQLite begins only to write)
        self.reader = engine.execution_options(isolation_level="AUTOCOMMIT") if engine.dialect.name == "postgresql" \
            else engine
        self.retention_s, self.max_turns = retention_s, max_turns
        self._walk = self._walk_query()
        self._insert = insert(StoredResponse.__table__)
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []  # saved, not yet committed
        self._committing: asyncio.Future | None = None
        self.app_bytes: dict[str, int] = {}  # app → what its stored responses take, as last read or committed
        upsert = (postgresql if engine.dialect.name == "postgresql" else sqlite).insert(StoredResponseBytes)
        self._add_bytes = (upsert.on_conflict_do_update(index_elements=[StoredResponseBytes.app],
                                                        set_={"bytes": StoredResponseBytes.bytes + upsert.excluded.bytes})
                           .returning(StoredResponseBytes.bytes))

    def _mine(self, app: str, user: str | None, now: datetime):
        return ((StoredResponse.app == app) & (StoredResponse.user == (user or ""))
                & (StoredResponse.expires_at > now))

    @_unavailable
    async def chain(self, app: str, user: str | None, response_id: str, now: datetime) -> list[Turn] | None:
        """The turns up to ``response_id``, oldest first; None if it is not this tenant's, or it or a turn before
        it is past retention. ChainTooLong past ``max_turns`` (the query reads no further)."""
        async with self.reader.connect() as conn:
            rows = (await conn.execute(self._walk, {"id": response_id, "app": app, "user": user or "", "now": now,
                                                    "turns": self.max_turns})).all()
        if not rows:
            return None
        if rows[-1].turn >= self.max_turns:
            raise ChainTooLong(rows[-1].turn)
        if [row.turn for row in rows] != list(range(1, rows[-1].turn + 1)):  # a turn before it expired, or is gone
            return None
        loads = orjson.loads
        return [Turn(row.id, row.interaction, row.turn, row.chain_bytes, row.backend, loads(row.input_items),
                     loads(row.output_items)) for row in rows]

    @staticmethod
    def _walk_query():
        """The chain from a response back to its first turn, within the tenant's scope and retention, at most
        ``turns`` deep: one recursive query, built once."""
        r = StoredResponse
        mine = ((r.app == bindparam("app")) & (r.user == bindparam("user")) & (r.expires_at > bindparam("now")))
        walk = (select(r.id, r.previous_id, r.turn, literal(1).label("depth")).where((r.id == bindparam("id")) & mine)
                .cte("walk", recursive=True))
        walk = walk.union_all(select(r.id, r.previous_id, r.turn, (walk.c.depth + 1).label("depth"))
                              .join(walk, r.id == walk.c.previous_id)
                              .where(mine & (walk.c.turn > 1) & (walk.c.depth < bindparam("turns"))))
        return (select(r.id, r.interaction, r.turn, r.chain_bytes, r.backend, r.input_items, r.output_items)
                .join(walk, r.id == walk.c.id).order_by(r.turn))  # (the items read once, not carried along)

    async def save(self, response_id: str, app: str, user: str | None, previous: Turn | None, interaction: str,
                   backend: str | None, input_items: list[Any], output_items: list[Any], response: dict[str, Any],
                   now: datetime) -> None:
        """Store a response; returns once it is committed (so a follow-up on any replica finds it). Responses
        saved while a commit is under way go together in the next one: one transaction for many (group commit)."""
        inputs, outputs = orjson.dumps(input_items), orjson.dumps(output_items)
        row = {"id": response_id, "app": app, "user": user or "", "previous_id": previous.id if previous else None,
               "interaction": interaction, "turn": previous.turn + 1 if previous else 1,
               "chain_bytes": (previous.chain_bytes if previous else 0) + len(inputs) + len(outputs),
               "backend": backend, "created_at": now, "expires_at": now + timedelta(seconds=self.retention_s),
               "input_items": inputs.decode(), "output_items": outputs.decode(),
               "response": orjson.dumps(response).decode()}
        row["size_bytes"] = len(inputs) + len(outputs) + len(row["response"].encode())
        committed = asyncio.get_running_loop().create_future()
        self._pending.append((row, committed))
        if self._committing is None or self._committing.done():
            self._committing = asyncio.ensure_future(self._commit())
        await asyncio.shield(committed)  # (a client that leaves does not take its turn out of the batch)

    async def _commit(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            added: dict[str, int] = {}
            for row, _ in batch:
                added[row["app"]] = added.get(row["app"], 0) + row["size_bytes"]
            try:
                async with self.engine.begin() as conn:
                    await conn.execute(self._insert, [row for row, _ in batch])
                    totals = {app: (await conn.execute(self._add_bytes, {"app": app, "bytes": n})).scalar_one()
                              for app, n in sorted(added.items())}  # (in one order: no two replicas deadlock)
                self.app_bytes.update(totals)
            except Exception as e:  # noqa: BLE001 — each waiting request is told
                for _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                        done.exception()  # (retrieved: a request that left does not leave it unread)
            else:
                for _, done in batch:
                    if not done.done():
                        done.set_result(None)

    @_unavailable
    async def get(self, app: str, user: str | None, response_id: str, now: datetime,
                  what: str = "response") -> Any:
        """One field of a stored response: ``response`` or ``input_items`` (the JSON as stored), or ``turn``."""
        column = {"response": StoredResponse.response, "input_items": StoredResponse.input_items,
                  "turn": StoredResponse.turn}[what]  # (only what is asked is read)
        async with self.reader.connect() as conn:
            return (await conn.execute(select(column).where(
                (StoredResponse.id == response_id) & self._mine(app, user, now)))).scalar_one_or_none()

    @_unavailable
    async def delete(self, app: str, user: str | None, response_id: str, now: datetime) -> bool:
        async with self.engine.begin() as conn:
            gone = (await conn.execute(delete(StoredResponse).where(
                (StoredResponse.id == response_id) & self._mine(app, user, now))
                .returning(StoredResponse.app, StoredResponse.size_bytes))).all()
            freed = await self._forget(conn, gone)
        self._freed(freed)
        return bool(gone)

    async def purge(self, now: datetime) -> int:
        """Forget the responses past retention."""
        async with self.engine.begin() as conn:
            gone = (await conn.execute(delete(StoredResponse).where(StoredResponse.expires_at <= now)
                                       .returning(StoredResponse.app, StoredResponse.size_bytes))).all()
            freed = await self._forget(conn, gone)
        self._freed(freed)
        return len(gone)

    async def _forget(self, conn, gone) -> dict[str, int]:
        """Take the bytes of the responses ``gone`` off their apps' totals (in their deletion's transaction)."""
        freed: dict[str, int] = {}
        for app, size in gone:
            freed[app] = freed.get(app, 0) + size
        for app, n in sorted(freed.items()):
            await conn.execute(update(StoredResponseBytes).where(StoredResponseBytes.app == app)
                               .values(bytes=StoredResponseBytes.bytes - n))
        return freed

    def _freed(self, freed: dict[str, int]) -> None:
        """What a committed deletion freed, off this replica's view of the totals."""
        for app, n in freed.items():
            if app in self.app_bytes:
                self.app_bytes[app] -= n

    async def refresh(self) -> None:
        """Every app's total as the database holds it (what other replicas stored included). O(apps)."""
        async with self.reader.connect() as conn:
            self.app_bytes = dict((await conn.execute(select(StoredResponseBytes.app,
                                                             StoredResponseBytes.bytes))).all())

    def over_cap(self, app: str, cap: int) -> int | None:
        """What ``app``'s stored responses take if it reached ``cap``, else None."""
        have = self.app_bytes.get(app, 0)
        return have if have >= cap else None
