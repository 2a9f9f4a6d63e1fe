"""A string a client chose, made safe to show an operator: in a log line, a metric's label, a terminal's table."""

from __future__ import annotations


def printable(value: str) -> str:
    """``value`` with every character that is not printable (controls, escape sequences, bidi overrides and other
    format characters, line and paragraph separators) written as ``\\uXXXX``: a name never reorders, breaks,
    colours or clears what shows it."""
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else f"\\u{ord(c):04x}" for c in value)
