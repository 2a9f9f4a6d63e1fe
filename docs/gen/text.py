"""Text helpers shared by the reference page generators."""

from __future__ import annotations

import re

import yaml

# A page must not point at design notes outside the repository (tests/test_docs.py keeps the code from citing
# them); should such a parenthetical slip into a comment, it is dropped from generated text.
_OUTSIDE = re.compile(r"\s*\((?:[^()]*?)(?:notes/|ARCHITECTURE\.md|\.\./shared)[^()]*\)")
# The code cites the documentation as docs/PAGE.md#anchor; on a generated page (all under reference/) that
# becomes a link, which the strict build then checks.
_DOCS_REF = re.compile(r"\bdocs/((?:[\w-]+/)*[\w-]+\.md(?:#[\w-]+)?)")


def clean(text: str | None) -> str:
    text = _OUTSIDE.sub("", text or "")
    return " ".join(text.split())


def link_docs(text: str) -> str:
    """``docs/PAGE.md#anchor`` in generated text as a link from a page under reference/."""
    return _DOCS_REF.sub(lambda m: f"[{m.group(1)}](../{m.group(1)})", text)


def cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped, angle brackets as entities, one line."""
    return link_docs(clean(text).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;"))


def code(text: str) -> str:
    """An inline code span (Python-Markdown's tables keep a pipe inside backticks in its cell)."""
    text = str(text)
    fence = "``" if "`" in text else "`"
    return f"{fence}{text}{fence}"


def yaml_value(value) -> str:
    if isinstance(value, str) and value == "":
        return '""'
    out = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10_000).strip()
    return out[:-4].strip() if out.endswith("\n...") else out


# ---------------------------------------------------------------------------------------- configuration
