"""Usage rows into SQL near the driver's own speed: the INSERT is compiled once per dialect and each batch goes
to the driver as one executemany of plain tuples, through the connection's open transaction
(``exec_driver_sql``), skipping the per-row work of a Core insert (parameter processing by name, statement
caching lookups).

A row becomes its tuple when it is queued (``converter``): each value fitted to its column (``row_fit``), the
column's default applied, then the column's bind processor, in one pass chosen once per column. The work is
spread over the requests as they end rather than done in one burst per batch, which stalled the event loop
(~10 ms for 450 rows). Stored is exactly what a Core insert stores (``tests/test_usage_insert.py``)."""

from __future__ import annotations

import operator
from datetime import datetime, timezone
from typing import Any, Callable

import orjson
from sqlalchemy import Table
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncSession

from fairgate.storage.row_fit import INT32, _same, fitter_for, kept, string_length

Convert = Callable[[dict[str, Any]], tuple]
_MISSING = object()


class BulkInsert:
    def __init__(self, table: Table, unique: str | None = None):
        """``unique``: a column with a unique index; a row whose value is there already is skipped (ON CONFLICT
        DO NOTHING), so a batch written again stores each row once."""
        self.table, self.unique = table, unique
        self.columns = [c.name for c in table.columns if not (c.primary_key and c.autoincrement in (True, "auto"))]
        self._compiled: dict[str, tuple[str, list[str], Convert]] = {}

    def _for(self, dialect: Dialect) -> tuple[str, list[str], Convert]:
        done = self._compiled.get(dialect.name)
        if done is None:
            compiled = self._statement(dialect).compile(dialect=dialect, column_keys=self.columns)
            order = list(compiled.positiontup or self.columns)
            cols = {c.name: c for c in self.table.columns}
            procs = [cols[name].type.dialect_impl(dialect).bind_processor(dialect) for name in order]
            steps = [_step(fitter_for(cols[name].type, cols[name].nullable), _faster(proc))
                     for name, proc in zip(order, procs)]
            defaults = [_default(cols[name]) for name in order]
            values_of = operator.itemgetter(*order)
            # by kind, the columns whose value of the usual kind is stored as it is (fitted already, and no bind
            # processor): checked inline; every other value, and every other column's, goes through its step
            strings: list[tuple[int, int]] = []
            ints: list[int] = []
            others: list[int] = []
            for i, name in enumerate(order):
                kind = kept(cols[name].type) if procs[i] is None else None
                if kind is str:
                    strings.append((i, string_length(cols[name].type)))
                elif kind is int:
                    ints.append(i)
                elif steps[i] is not None:
                    others.append(i)

            def convert(row: dict[str, Any]) -> tuple:
                try:
                    out = list(values_of(row))
                except KeyError:  # a row missing columns (an earlier version's): their defaults, else NULL
                    out = [row.get(name, _MISSING) for name in order]
                    for i, value in enumerate(out):
                        if value is _MISSING:
                            out[i] = None if defaults[i] is None else defaults[i]()
                for i, limit in strings:
                    v = out[i]
                    if v is not None and not (type(v) is str and len(v) <= limit and v.isascii()
                                              and "\x00" not in v):
                        out[i] = steps[i](v)
                for i in ints:
                    v = out[i]
                    if v is not None and not (type(v) is int and INT32[0] <= v <= INT32[1]):
                        out[i] = steps[i](v)
                for i in others:
                    v = out[i]
                    if v is not None:
                        out[i] = steps[i](v)
                return tuple(out)

            done = (compiled.string, order, convert)
            self._compiled[dialect.name] = done
        return done

    def _statement(self, dialect: Dialect):
        if self.unique is None:
            return self.table.insert()
        if dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif dialect.name == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:
            raise ValueError(f"no ON CONFLICT DO NOTHING for {dialect.name}")
        return insert(self.table).on_conflict_do_nothing(index_elements=[self.unique])

    def converter(self, dialect: Dialect) -> Convert:
        """Row (dict keyed by column; missing keys take the column's default, else NULL) → the tuple ``insert``
        sends for ``dialect``."""
        return self._for(dialect)[2]

    def as_dict(self, dialect: Dialect, values: tuple) -> dict[str, Any]:
        """A converted row back as a dict (for the dead-letter file; dates may be text)."""
        return dict(zip(self._for(dialect)[1], values))

    def index(self, dialect: Dialect, column: str) -> int:
        return self._for(dialect)[1].index(column)

    async def insert(self, session: AsyncSession, tuples: list[tuple]) -> None:
        """Insert rows already converted for the session's dialect, in the session's transaction."""
        conn = await session.connection()
        await conn.exec_driver_sql(self._for(conn.dialect)[0], tuples)


def _step(fit: Callable[[Any], Any], proc: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """One column's work on a non-NULL value: fit, then the bind processor (None: nothing to do)."""
    if proc is None:
        return None if fit is _same else fit
    if fit is _same:
        return proc
    return lambda value: (None if (fitted := fit(value)) is None else proc(fitted))


_PROBES = (datetime(2026, 11, 24, 1, 2, 3, 456789, tzinfo=timezone.utc), datetime(2026, 1, 1),
           datetime(999, 12, 31, 23, 59, 59, 1, tzinfo=timezone.utc))


def _faster(proc: Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """A date column's bind processor on SQLite formats with ``%`` and a dict of seven fields (~13k
    instructions, four per row); ``_iso`` writes the same text for a fraction of that. Used only where it
    gives exactly what the processor gives on probes (its storage format is the default), else the processor
    itself."""
    if proc is None:
        return None
    try:
        same = all(proc(p) == _iso(p) for p in _PROBES)
    except Exception:  # noqa: BLE001 — not a date column's processor
        return proc
    if not same:
        return proc
    return lambda value: _iso(value) if type(value) is datetime else proc(value)


def _iso(value: datetime) -> str:
    """``value.isoformat(" ", "microseconds")[:26]``, at a third of its cost: orjson writes the same digits
    (``"YYYY-MM-DDTHH:MM:SS.ffffff…"``, without the fraction when it is 0)."""
    text = orjson.dumps(value)
    if len(text) >= 28 and text[20] == 46:  # (46: the fraction's ".")
        return text[1:27].decode().replace("T", " ", 1)
    return value.isoformat(" ", "microseconds")[:26]


def _default(column) -> Any:
    """The column's Python-side default (a Core insert applies it to a missing key), as a zero-argument
    function, or None."""
    d = column.default
    if d is None:
        return None
    if d.is_callable:
        return lambda: d.arg(None)
    return lambda: d.arg
