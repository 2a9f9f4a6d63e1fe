"""Fit a row to its table before it reaches SQL: a value a client steered (an id, a header, a count) must never
make a batch fail. Strings lose NUL bytes and lone surrogates (as '?') and are cut to their column's length,
integers are clamped to a 32-bit column, floats that are not finite become NULL; what is not the column's type
is converted or dropped.

The fitting functions are chosen once per table (``Fitter``), not looked up per value: a usage row is fitted on
the hot path, once per request."""

from __future__ import annotations

import math
from typing import Any, Callable

from sqlalchemy import Boolean, Float, Integer, String, Table, Text

INT32 = (-(2**31), 2**31 - 1)
TEXT_MAX = 4000  # an error message or a JSON blob: plenty for an audit row


def _string(limit: int) -> Callable[[Any], Any]:
    def fit(value: Any) -> Any:
        text = value if type(value) is str else str(value)
        if "\x00" in text:
            text = text.replace("\x00", "")
        if not text.isascii():  # a header's invalid UTF-8 arrives as surrogate escapes, which no driver encodes
            text = text.encode("utf-8", "replace").decode("utf-8")
        return text if len(text) <= limit else text[:limit]
    return fit


def _integer(nullable: bool) -> Callable[[Any], Any]:
    def fit(value: Any) -> Any:
        if type(value) is int:
            number = value
        else:
            if isinstance(value, float) and not math.isfinite(value):
                return None if nullable else 0
            try:
                number = int(value)
            except (TypeError, ValueError):
                return None if nullable else 0
        return number if INT32[0] <= number <= INT32[1] else min(max(number, INT32[0]), INT32[1])
    return fit


def _float(value: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _same(value: Any) -> Any:
    return value  # dates are made by the gateway itself


def string_length(kind) -> int:
    """The most characters a string column of ``kind`` keeps."""
    return getattr(kind, "length", None) or TEXT_MAX


def kept(kind) -> type | None:
    """The type of the values a column of ``kind`` stores as they are when already fitted — a str within its
    length, ASCII, without NUL; an int within 32 bits — which a caller may check inline instead of calling the
    fitter; None for the other kinds."""
    if isinstance(kind, (String, Text)):
        return str
    if isinstance(kind, Integer) and not isinstance(kind, Boolean):
        return int
    return None


def fitter_for(kind, nullable: bool) -> Callable[[Any], Any]:
    if isinstance(kind, (String, Text)):
        return _string(string_length(kind))
    if isinstance(kind, Boolean):
        return bool
    if isinstance(kind, Integer):
        return _integer(nullable)
    if isinstance(kind, Float):
        return _float
    return _same


class Fitter:
    """Fits rows to one table's columns."""

    def __init__(self, table: Table):
        self.fits = [(c.name, fitter_for(c.type, c.nullable)) for c in table.columns]

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with every known column's value fitted to the column (unknown keys are dropped)."""
        out = {}
        for name, fit in self.fits:
            if name in row:
                value = row[name]
                out[name] = None if value is None else fit(value)
        return out

