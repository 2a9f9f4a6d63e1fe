"""``reference/cli.md`` from the click command ``fairgate`` runs: click's introspection walks every command
and subcommand."""

from __future__ import annotations

import enum
import re
import textwrap
import typing

from gen.text import cell, clean, code


def _choices(param) -> list[str]:
    choices = getattr(getattr(param, "type", None), "choices", None)
    if choices:
        return [getattr(c, "value", c) for c in choices]
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return [str(m.value) for m in ann]
    if typing.get_origin(ann) is typing.Literal:
        return [str(a) for a in typing.get_args(ann)]
    return []


def _context(command, name, parent):
    return command.make_context(name, [], parent=parent, resilient_parsing=True)


def _is_group(command) -> bool:
    return hasattr(command, "list_commands") and hasattr(command, "get_command")


def _walk(command, ctx):
    yield command, ctx
    if _is_group(command):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is None or getattr(sub, "hidden", False):
                continue
            yield from _walk(sub, _context(sub, name, ctx))


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _argument(param) -> str:
    """An argument as a usage line names it: NAME, [NAME] when optional, FIELDS... when repeatable (typer's
    own rendering, {name} and <list[str]>, is for its rich help panels)."""
    name = (param.name or "").upper() + ("..." if getattr(param, "nargs", 1) != 1 else "")
    return name if param.required else f"[{name}]"


def _usage(command, ctx) -> list[str]:
    """The usage line's pieces, arguments as ``_argument`` names them."""
    pieces = command.collect_usage_pieces(ctx)
    for param in command.params:
        if getattr(param, "param_type_name", "") == "argument":
            for piece in param.get_usage_pieces(ctx):
                if piece in pieces:
                    pieces[pieces.index(piece)] = _argument(param)
    return pieces


def _param_row(param, ctx) -> str | None:
    if getattr(param, "hidden", False):
        return None
    record = param.get_help_record(ctx) if hasattr(param, "get_help_record") else None
    kind = getattr(param, "param_type_name", "option")
    if kind == "argument":
        decl = _argument(param)
    elif record:
        decl = record[0]
        # a choice's placeholder (<a|b|c>, <list[a|b]>) repeats what the description lists
        if " <" in decl and "|" in decl:
            decl = decl[:decl.index(" <")] + " CHOICE"
    else:
        decl = ", ".join(param.opts + list(getattr(param, "secondary_opts", []) or []))
    text = getattr(param, "help", None) or ""
    if not text and record:  # no help attribute: the rendered text, less its [default: …] extras
        text = re.sub(r"\s*\[[^\]]*\]\s*$", "", record[1] or "")
    notes = []
    choices = _choices(param)
    if choices:
        notes.append("one of " + ", ".join(code(c) for c in choices))
    if (getattr(param, "multiple", False) or (kind == "argument" and getattr(param, "nargs", 1) == -1)) \
            and "repeat" not in text.lower():
        notes.append("repeatable")
    envvar = getattr(param, "envvar", None)
    if envvar:
        notes.append("env " + ", ".join(code(e) for e in ([envvar] if isinstance(envvar, str) else envvar)))
    default = getattr(param, "default", None)
    show = getattr(param, "show_default", True)
    if param.required:
        shown = "*required*"
    elif callable(default) or default is None or default == [] or default == () or show is False:
        shown = ""
    elif isinstance(default, bool):
        shown = code("on" if default else "off")
    elif isinstance(default, (list, tuple)):
        shown = code(", ".join(str(getattr(d, "value", d)) for d in default))
    else:
        shown = code(getattr(default, "value", default))
    desc = cell(text)
    if notes:
        desc = (desc.rstrip(".") + "; " if desc else "") + "; ".join(notes)
    return f"| {code(decl)} | {shown} | {desc} |"


def cli_page() -> str:
    from fairgate.cli import main

    # the click command `fairgate` itself runs (main.command(): flags without a placeholder, values with a
    # plain one, TEXT, INT, FLOAT), so the page reads as `fairgate … --help` does
    root = main.command()
    root_ctx = root.make_context("fairgate", [], resilient_parsing=True)
    lines = [
        "# CLI reference",
        "",
        "!!! note \"Generated\"",
        "    This page is generated when the site is built, by walking the `fairgate` command (the click",
        "    command `fairgate.cli.main.command()` makes of the typer app) with click's introspection. Every",
        "    command's own help text is here as `fairgate … --help` prints it; change the code, not this page.",
        "",
    ]
    lines += [
        "## Conventions",
        "",
        "- `-h` and `--help` work on every command and group; `fairgate --version` prints the version.",
        "- Every command that touches SQL takes `--database-url` (default `$FAIRGATE_DATABASE_URL`, else",
        "  `fairgate.db` in the [data directory](configuration.md#the-data-directory): `$FAIRGATE_HOME`, else",
        "  `$XDG_DATA_HOME/fairgate`, else `~/.local/share/fairgate`); plain `sqlite://` and `postgresql://`",
        "  URLs are given their async drivers.",
        "- Times are ISO 8601 (UTC when no zone is given), `now`, `today` or `yesterday` (their UTC",
        "  midnights), or a span back from now (`30s`, `30m`, `24h`, `7d`, `2w`).",
        "- An option shown with `CHOICE` takes one of the values its description lists; `TEXT`, `INT` and",
        "  `FLOAT` are a string, an integer and a number; an argument in brackets may be left out, and one",
        "  followed by `...` may be repeated.",
        "- `--json` prints machine-readable output; otherwise tables.",
        "- Every admin change writes an audit row; the actor is `--actor`, else `$FAIRGATE_ACTOR`.",
        "- On a brand-new, empty database `serve` and `admin` create the schema; on one that is behind, `serve`",
        "  refuses to start and names [`fairgate db upgrade`](#fairgate-db-upgrade).",
        "",
    ]
    commands = list(_walk(root, root_ctx))
    lines += ["## Commands", ""]
    for command, ctx in commands:
        path = ctx.command_path
        depth = path.count(" ")
        summary = clean(command.get_short_help_str(limit=100)) if hasattr(command, "get_short_help_str") else ""
        lines.append(f"{'    ' * max(depth - 1, 0)}- [`{path}`](#{_anchor(path)})"
                     + (f": {summary}" if summary and depth else ""))
    lines.append("")
    for command, ctx in commands:
        path = ctx.command_path
        lines += [f"## `{path}` {{#{_anchor(path)}}}", ""]
        if command.help:
            lines += [textwrap.dedent(command.help).strip().replace("\b\n", ""), ""]
        pieces = _usage(command, ctx)
        lines += ["```", f"{path} {' '.join(pieces)}".rstrip(), "```", ""]
        if _is_group(command):
            subs = [n for n in command.list_commands(ctx)
                    if not getattr(command.get_command(ctx, n), "hidden", False)]
            lines += ["Subcommands: " + ", ".join(f"[`{n}`](#{_anchor(path + ' ' + n)})" for n in subs) + ".", ""]
        rows = [r for r in (_param_row(p, ctx) for p in command.params) if r]
        if rows:
            lines += ["| option / argument | default | description |", "|---|---|---|", *rows, ""]
        if getattr(command, "epilog", None):
            lines += [clean(command.epilog), ""]
    return "\n".join(lines)
