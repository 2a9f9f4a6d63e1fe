"""Database URLs, engines, and the schema's migration state (Alembic)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, inspect
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine



def data_dir() -> Path:
    """Where fairgate keeps its files by default: $FAIRGATE_HOME, else $XDG_DATA_HOME/fairgate, else
    ~/.local/share/fairgate — one place whatever the working directory, so an admin command run elsewhere
    reads the gateway's database instead of silently creating an empty one."""
    home = os.environ.get("FAIRGATE_HOME")
    if home:
        return Path(home).expanduser().resolve()
    return (Path(os.environ.get("XDG_DATA_HOME") or "~/.local/share").expanduser() / "fairgate").resolve()


DEFAULT_DATABASE_URL = f"sqlite:///{data_dir() / 'fairgate.db'}"
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


class SchemaBehind(RuntimeError):
    pass


def async_url(url: str) -> str:
    """Accept plain URLs and pick the async driver: sqlite → aiosqlite, postgresql → asyncpg."""
    for plain, driver in (("sqlite://", "sqlite+aiosqlite://"), ("postgresql://", "postgresql+asyncpg://"),
                          ("postgres://", "postgresql+asyncpg://")):
        if url.startswith(plain):
            return driver + url[len(plain):]
    return url


_NULL_ADAPTER = {}.get  # (None → None, in C)


def make_engine(url: str) -> AsyncEngine:
    if url == DEFAULT_DATABASE_URL:
        data_dir().mkdir(parents=True, exist_ok=True)
    url = async_url(url)
    if url.startswith("sqlite"):
        # A None bound as a parameter goes through the driver's adapter lookup: a registry miss, then two
        # attribute lookups, about as dear as the rest of a usage row's insert (a dozen NULLs a row). Registered,
        # None is found at once and adapted, by a C function, to None: the same NULL, for every sqlite3 user.
        sqlite3.register_adapter(type(None), _NULL_ADAPTER)
        # One connection per process: SQLite has a single writer anyway, and serialising in the pool means the
        # gateway's own sessions never wait on each other's file locks (only other processes, e.g. the CLI).
        engine = create_async_engine(url, connect_args={"timeout": 30}, pool_size=1, max_overflow=0,
                                     pool_timeout=60)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(conn, _record):  # WAL lets the admin CLI write while the gateway reads and logs
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL syncs at checkpoints, not at every commit: a commit survives a crash of the
            # process (the rows the writer still gathers, up to 0.2 s of them, are what a crash can lose) and
            # only a power cut can undo the last ones; FULL's fsync per commit cost the usage writer most of its time
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_async_engine(url, pool_size=10, max_overflow=10, pool_pre_ping=True)


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _state(sync_conn) -> tuple[str | None, bool]:
    current = MigrationContext.configure(sync_conn).get_current_revision()
    has_tables = bool(set(inspect(sync_conn).get_table_names()) - {"alembic_version"})
    return current, has_tables


def _upgrade(sync_conn) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = sync_conn
    command.upgrade(cfg, "head")


async def upgrade(engine: AsyncEngine) -> str:
    async with engine.begin() as conn:
        await conn.run_sync(_upgrade)
    return head_revision()


async def ensure_schema(engine: AsyncEngine) -> str:
    """Create the schema on a brand-new database; refuse one that is behind (or unknown)."""
    async with engine.connect() as conn:
        current, has_tables = await conn.run_sync(_state)
    head = head_revision()
    if current == head:
        return head
    if current is None and not has_tables:
        return await upgrade(engine)
    raise SchemaBehind(
        f"the database schema is at revision {current or '(none)'} but this fairgate needs {head}; "
        "run `fairgate db upgrade` (with the same --database-url) and start again")
