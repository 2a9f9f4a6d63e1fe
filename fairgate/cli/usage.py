"""`fairgate usage`: audit queries over the usage log."""

from __future__ import annotations

import csv
import json
import sys
from enum import Enum

import typer

from fairgate.cli.common import TIME_HELP, DatabaseOption, JsonOption, emit, parse_time, with_db
from fairgate.storage import usage_queries as q

usage = typer.Typer(help="Audit queries over the per-request usage log (one row per request with a valid key).",
                    no_args_is_help=True)
SinceOption = typer.Option(None, "--since", help=f"From this time: {TIME_HELP}")
UntilOption = typer.Option(None, "--until", help=f"Up to this time (excluded): {TIME_HELP}")
UserOption = typer.Option(None, "--user", help="Only this user's requests.")
AppOption = typer.Option(None, "--app", help="Only this app's requests.")
InteractionOption = typer.Option(None, "--interaction", help="Only this interaction's requests.")
# every request is in exactly one outcome column, so they add up to ``requests``
SUMMARY_COLUMNS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "ok",
                   "errors", "cancelled", "throttled", "rejected", "slo_requests", "slo_met"]
NARROW = ["requests", "prompt_tokens", "completion_tokens", "errors", "throttled"]  # (without --wide)
WideOption = typer.Option(False, "--wide", help="Every column (by default the ones that fit a terminal).")
UNNAMED = {"model": "(no model)", "backend": "(not dispatched)", "user": "(no user)",  # in tables
           "slo_class": "(no class)"}


class By(str, Enum):
    user = "user"
    app = "app"
    interaction = "interaction"
    model = "model"
    backend = "backend"
    slo_class = "slo_class"
    day = "day"
    hour = "hour"


ByOption = typer.Option([By.user.value], "--by", help="Group by user, app, interaction, model, backend, slo_class, "
                        "day or hour (UTC); repeat to combine: --by user --by day.")


def _filters(user: str | None, app: str | None, interaction: str | None) -> dict[str, str | None]:
    return {"user": user, "app": app, "interaction": interaction}


def _summary(by: list[By], rows: list[dict], json_: bool, title: str, wide: bool = False) -> None:
    groups = [c.key for c in q.group_keys([b.value for b in by])]
    if not json_:  # rows that never reached a model or a backend (refused, throttled) say so
        rows = [{**r, **{k: label for k, label in UNNAMED.items() if k in groups and r.get(k) is None}}
                for r in rows]
    emit(rows, json_, [*groups, *SUMMARY_COLUMNS], title=title, narrow=[*groups, *NARROW], wide=wide)


@usage.command("summary")
def summary(by: list[By] = ByOption, since: str = SinceOption, until: str = UntilOption,
            top: int = typer.Option(None, "--top", help="Only the N biggest by total tokens."),
            user: str = UserOption, app: str = AppOption, interaction: str = InteractionOption,
            wide: bool = WideOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """Requests, tokens and outcomes per group over a time range, e.g. who used how many tokens yesterday:
    `fairgate usage summary --by user --by day --since yesterday --until today`."""
    rows = with_db(db, lambda s: q.summary(s, [b.value for b in by], parse_time(since), parse_time(until), top,
                                           **_filters(user, app, interaction)))
    _summary(by, rows, json_, f"usage by {', '.join(b.value for b in by)}", wide)


@usage.command("top")
def top(n: int = typer.Argument(10, help="How many."), by: list[By] = ByOption, since: str = SinceOption,
        until: str = UntilOption, wide: bool = WideOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """The N biggest consumers by total tokens."""
    rows = with_db(db, lambda s: q.summary(s, [b.value for b in by], parse_time(since), parse_time(until), n))
    _summary(by, rows, json_, f"top {n} by {', '.join(b.value for b in by)}", wide)


@usage.command("failures")
def failures(since: str = typer.Option("24h", "--since", help=f"From this time: {TIME_HELP}"),
             until: str = UntilOption, user: str = UserOption, app: str = AppOption,
             limit: int = typer.Option(100, "--limit", help="At most this many rows."),
             json_: bool = JsonOption, db: str = DatabaseOption):
    """Errors, cancellations, throttles and rejections, newest first (the last 24 hours by default)."""
    rows = with_db(db, lambda s: q.rows(s, parse_time(since), parse_time(until), failed_only=True, limit=limit,
                                        newest_first=True, **_filters(user, app, None)))
    emit(rows, json_, ["arrival", "request_id", "user", "app", "status", "http_status", "throttle_reason",
                       "error"], title="failed requests, newest first")


@usage.command("export")
def export(fmt: str = typer.Option("csv", "--format", help="csv or json (JSON lines)."), since: str = SinceOption,
           until: str = UntilOption, user: str = UserOption, app: str = AppOption,
           interaction: str = InteractionOption,
           out: str = typer.Option(None, "--out", help="File to write (default: stdout)."), db: str = DatabaseOption):
    """Every usage row in the range, oldest first, as CSV or JSON lines."""
    rows = with_db(db, lambda s: q.rows(s, parse_time(since), parse_time(until),
                                        **_filters(user, app, interaction)))
    f = open(out, "w", newline="") if out else sys.stdout
    try:
        if fmt == "json":
            for r in rows:
                f.write(json.dumps(r, default=str) + "\n")
        elif fmt == "csv":
            if rows:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows({k: _inert(v) for k, v in r.items()} for r in rows)
        else:
            raise typer.BadParameter("--format must be csv or json")
    finally:
        if out:
            f.close()
    if out:
        typer.echo(f"{len(rows)} rows → {out}", err=True)


class SpendBy(str, Enum):
    app = "app"
    user = "user"
    key = "key"


@usage.command("spend")
def spend(by: SpendBy = typer.Option(SpendBy.app.value, "--by", help="app, user or key."),
          since: str = typer.Option(None, "--since", help=f"From this time: {TIME_HELP} (default: each one's budget "
                                    "period, this month without one)."),
          timezone: str = typer.Option("UTC", "--timezone", help="Where periods begin: the gateways' "
                                       "budget_timezone."),
          json_: bool = JsonOption, db: str = DatabaseOption):
    """Tokens and money spent against each budget, from the usage log."""
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from fairgate.cli.common import fail
    from fairgate.quota.spend import spend as spent

    try:
        ZoneInfo(timezone)
    except (ValueError, KeyError, ZoneInfoNotFoundError):
        fail(f"--timezone {timezone!r} is not an IANA time zone")
    start = parse_time(since) if since else None
    rows = with_db(db, lambda sessions: spent(sessions, by.value, start, timezone))
    emit(rows, json_, [*(["app", "user"] if by is SpendBy.user else [by.value]), "tokens", "usd", "budget_tokens",
                       "budget_usd", "period"], title="spend")


@usage.command("recover")
def recover(journal: str = typer.Argument(..., help="The journal's path: a gateway's `usage_journal` (its "
                                                     "segments are PATH.0, PATH.1, …)."),
            db: str = DatabaseOption):
    """Write the rows a stopped gateway's usage journal holds (a replica killed, its host gone) into the database,
    each once: a row already there is skipped. Refused while the gateway that owns the journal runs."""
    from fairgate.storage.usage_journal import Journal, JournalBusy
    from fairgate.storage.usage_writer import UsageWriter

    try:
        j = Journal(journal)
    except JournalBusy as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    if not j.leftover:
        j.close()
        typer.echo(f"{journal}: nothing to recover")
        return

    rows = sum(1 for _, path in j.leftover for _ in Journal.read(path))

    async def run(sessions) -> None:
        writer = UsageWriter(sessions, journal=j)
        await writer.start()  # (it writes what the journal holds first)
        await writer.close()

    with_db(db, run)
    if j.segments():
        typer.echo(f"error: the database did not take every row; {journal} keeps them", err=True)
        raise typer.Exit(1)
    typer.echo(f"{journal}: {rows} rows recovered (those the database held already were skipped)")


def _inert(value):
    """A CSV cell a spreadsheet shows and never evaluates: a text that would read as a formula (``=``, ``+``,
    ``-``, ``@``, a tab or a return first: a user name, an error a client's input shaped) is given a leading
    ``'``, as OWASP advises; numbers as they are."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value
