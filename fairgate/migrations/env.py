"""Alembic environment: runs on the connection fairgate hands it, or opens one from the URL given."""

from __future__ import annotations

import asyncio

from alembic import context

from fairgate.storage.models import Base

config = context.config
target_metadata = Base.metadata


def run(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


async def run_from_url(url: str) -> None:
    from fairgate.storage.db import make_engine

    engine = make_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(run)
    await engine.dispose()


connection = config.attributes.get("connection")
if connection is not None:
    run(connection)
else:
    asyncio.run(run_from_url(config.get_main_option("sqlalchemy.url")))
