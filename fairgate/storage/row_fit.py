"""Fit a row to its table before it reaches SQL: a value a client steered (an id, a header, a count) must never
make a batch fail. Strings lose NUL bytes and are cut to their column's length, integers are clamped to a
32-bit column, floats that are not finite become NULL; what is not the column's type is converted or dropped."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Boolean, Float, Integer, String, Table, Text

INT32 = (-(2**31), 2**31 - 1)
TEXT_MAX = 4000  # an error message or a JSON blob: plenty for an audit row


def _fit(kind, nullable: bool, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(kind, (String, Text)):
        text = value if isinstance(value, str) else str(value)
        limit = getattr(kind, "length", None) or TEXT_MAX
        return text.replace("\x00", "")[:limit]
    if isinstance(kind, Boolean):
        return bool(value)
    if isinstance(kind, Integer):
        if isinstance(value, float) and not math.isfinite(value):
            return None if nullable else 0
        try:
            number = int(value)
        except (TypeError, ValueError):
            return None if nullable else 0
        return min(max(number, INT32[0]), INT32[1])
    if isinstance(kind, Float):
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        return number if math.isfinite(number) else None
    return value  # dates are made by the gateway itself


def fit_row(table: Table, row: dict[str, Any]) -> dict[str, Any]:
    """The row with every known column's value fitted to the column (unknown keys are dropped)."""
    return {c.name: _fit(c.type, c.nullable, row[c.name]) for c in table.columns if c.name in row}
