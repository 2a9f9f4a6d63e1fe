"""Helpers shared by the CLI commands: database access, time arguments, output."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Awaitable, Callable, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fairgate.printable import printable
from fairgate.storage.db import DEFAULT_DATABASE_URL, SchemaBehind, ensure_schema, make_engine, sessionmaker

T = TypeVar("T")
console = Console()
DatabaseOption = typer.Option(None, "--database-url", help="SQL URL: sqlite:///PATH or postgresql://… (default: "
                              "$FAIRGATE_DATABASE_URL, else fairgate.db in $FAIRGATE_HOME, else in "
                              "$XDG_DATA_HOME/fairgate, else in ~/.local/share/fairgate).")
JsonOption = typer.Option(False, "--json", help="Machine-readable output.")
ActorOption = typer.Option("cli", "--actor", envvar="FAIRGATE_ACTOR", help="Who makes the change (audit).")


def database_url(given: str | None) -> str:
    return given or os.environ.get("FAIRGATE_DATABASE_URL") or DEFAULT_DATABASE_URL


def with_db(url: str | None, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Run ``fn(sessions)`` against the database, creating the schema if the database is brand new."""

    async def main() -> T:
        engine = make_engine(database_url(url))
        try:
            await ensure_schema(engine)
            return await fn(sessionmaker(engine))
        finally:
            await engine.dispose()

    try:
        return asyncio.run(main())
    except SchemaBehind as e:
        fail(str(e))
        raise  # unreachable


def run_admin(url: str | None, actor: str, fn: Callable[[Any], Awaitable[T]]) -> T:
    """``fn(Admin)`` against the database; an unknown name or a conflict is a one-line error, not a trace."""
    from fairgate.storage.identity import Admin, Conflict, NotFound

    try:
        return with_db(url, lambda sessions: fn(Admin(sessions, actor)))
    except (NotFound, Conflict) as e:
        fail(str(e))
        raise  # unreachable


def parse_sets(sets: list[str]) -> dict[str, float]:
    """``--set NAME=NUMBER`` options as a map (a wrong one: an error naming it)."""
    params: dict[str, float] = {}
    for item in sets:
        name, eq, value = item.partition("=")
        try:
            params[name.strip()] = float(value)
        except ValueError:
            eq = ""
        if not eq or not name.strip():
            fail(f"--set takes NAME=NUMBER, not {item!r}")
    return params


def fail(message: str, code: int = 1) -> None:
    Console(stderr=True).print(f"[red]error:[/red] {message}")
    raise typer.Exit(code)


_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
TIME_HELP = ("ISO 8601 (UTC unless a zone is given), now, today or yesterday (UTC midnight), or a span back "
             "from now: 30m, 24h, 7d, 2w.")


def parse_time(value: str | None) -> datetime | None:
    """ISO 8601 (UTC if no zone), ``now``, ``today`` / ``yesterday`` (their UTC midnight), or a span back
    from now: 30s, 15m, 2h, 7d, 2w."""
    if value is None:
        return None
    word = value.strip().lower()
    now = datetime.now(timezone.utc)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if word in ("now", "today", "yesterday"):
        return {"now": now, "today": midnight, "yesterday": midnight - timedelta(days=1)}[word]
    m = _RELATIVE.match(word)
    if m:
        unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}[m.group(2)]
        return now - timedelta(**{unit: float(m.group(1))})
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        fail(f"cannot read time {value!r}: use ISO 8601 (2026-11-22T05:00), now, today, yesterday, or a span "
             "like 30m, 24h, 7d")
        raise
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def emit(data: Any, as_json: bool, columns: list[str] | None = None, title: str | None = None,
         narrow: list[str] | None = None, wide: bool = False) -> None:
    """Rows as JSON, or as a table for a terminal: the ``narrow`` columns that matter unless ``wide`` (all of
    ``columns``), headers in words, counts with thousands separators, money in dollars with the precision a
    small amount needs."""
    if as_json:
        sys.stdout.write(json.dumps(data, default=str) + "\n")
        return
    rows = data if isinstance(data, list) else [data]
    if not rows:
        console.print("(nothing)")
        return
    columns = columns or list(rows[0].keys())
    if narrow is not None and not wide:
        columns = [c for c in columns if c in narrow]
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False)  # (no rules: the room is the data's)
    for c in columns:
        numeric = any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool) for r in rows)
        table.add_column(_header(c), justify="right" if numeric else "left",
                         overflow="fold")  # ids are printed whole, folded over lines, never cut
    for r in rows:  # (each cell as text: a name a client chose is never read as markup, nor its escapes run)
        table.add_row(*(Text(printable(_money(r.get(c)) if c.endswith("usd") else str(r.get(c))
                                       if c == "id" or c.endswith("_id") else _cell(r.get(c)))) for c in columns))
    console.print(table)
    if narrow is not None and not wide and len(columns) < len(data[0] if isinstance(data, list) else data):
        console.print("[dim](--wide for every column, --json for the data)[/dim]")


HEADERS = {"prompt_tokens": "prompt tok", "completion_tokens": "output tok", "cached_tokens": "cached tok",
           "total_tokens": "total tok", "budget_tokens": "budget tok"}


def _header(column: str) -> str:
    """A column's name in words: ``prompt_tokens`` as "prompt tok", ``budget_usd`` as "budget $"."""
    return HEADERS.get(column) or column.replace("_usd", " $").replace("usd", "$").replace("_", " ")


def _money(value: Any) -> str:
    """Dollars: cents from a cent up, else the first two significant digits ($0.000011)."""
    if value is None or value == "":
        return ""
    v = float(value)
    if v == 0 or abs(v) >= 0.01:
        return f"${v:,.2f}"
    digits = max(2, 1 - math.floor(math.log10(abs(v))))
    return f"${v:.{digits}f}"


def _cell(value: Any) -> str:
    """A table cell: lists as ``a, b``, objects as ``k=v`` pairs, nothing for None."""
    if value is None:
        return ""
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    if isinstance(value, float):  # (a price or a weight as given; a large measure without its noise)
        return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:,.6g}"
    return str(value)
