"""`fairgate usage`: audit queries over the usage log."""

from __future__ import annotations

import csv
import json
import sys
from enum import Enum

import typer

from fairgate.cli.common import DatabaseOption, JsonOption, emit, parse_time, with_db
from fairgate.storage import usage_queries as q

usage = typer.Typer(help="Audit queries over the per-request usage log.", no_args_is_help=True)
SinceOption = typer.Option(None, "--since", help="ISO time (UTC) or a span back from now: 30m, 2h, 7d.")
UntilOption = typer.Option(None, "--until", help="ISO time (UTC) or a span back from now.")
SUMMARY_COLUMNS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens", "ok",
                   "errors", "cancelled", "throttled"]


class By(str, Enum):
    user = "user"
    app = "app"
    interaction = "interaction"
    model = "model"
    backend = "backend"


def _group_columns(by: By) -> list[str]:
    return [c.key for c in q.GROUPS[by.value]]


def _filters(user: str | None, app: str | None, interaction: str | None) -> dict[str, str | None]:
    return {"user": user, "app": app, "interaction": interaction}


@usage.command("summary")
def summary(by: By = typer.Option(By.user, "--by"), since: str = SinceOption, until: str = UntilOption,
            top: int = typer.Option(None, "--top", help="Only the N biggest by total tokens."),
            user: str = typer.Option(None, "--user"), app: str = typer.Option(None, "--app"),
            interaction: str = typer.Option(None, "--interaction"), json_: bool = JsonOption,
            db: str = DatabaseOption):
    """Requests and tokens per user, app or interaction over a time range."""
    rows = with_db(db, lambda s: q.summary(s, by.value, parse_time(since), parse_time(until), top,
                                           **_filters(user, app, interaction)))
    emit(rows, json_, [*_group_columns(by), *SUMMARY_COLUMNS], title=f"usage by {by.value}")


@usage.command("top")
def top(n: int = typer.Argument(10), by: By = typer.Option(By.user, "--by"), since: str = SinceOption,
        until: str = UntilOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """The N biggest consumers by total tokens."""
    rows = with_db(db, lambda s: q.summary(s, by.value, parse_time(since), parse_time(until), n))
    emit(rows, json_, [*_group_columns(by), *SUMMARY_COLUMNS], title=f"top {n} by {by.value}")


@usage.command("failures")
def failures(since: str = SinceOption, until: str = UntilOption, user: str = typer.Option(None, "--user"),
             app: str = typer.Option(None, "--app"), limit: int = typer.Option(100, "--limit"),
             json_: bool = JsonOption, db: str = DatabaseOption):
    """Errors, cancellations, throttles and rejections, oldest first."""
    rows = with_db(db, lambda s: q.rows(s, parse_time(since), parse_time(until), failed_only=True, limit=limit,
                                        **_filters(user, app, None)))
    emit(rows, json_, ["arrival", "request_id", "user", "app", "status", "http_status", "throttle_reason",
                       "error"], title="failed requests")


@usage.command("export")
def export(fmt: str = typer.Option("csv", "--format", help="csv or json"), since: str = SinceOption,
           until: str = UntilOption, user: str = typer.Option(None, "--user"), app: str = typer.Option(None, "--app"),
           interaction: str = typer.Option(None, "--interaction"),
           out: str = typer.Option(None, "--out", help="File to write (default: stdout)."), db: str = DatabaseOption):
    """Every usage row in the range, as CSV or JSON lines."""
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
                w.writerows(rows)
        else:
            raise typer.BadParameter("--format must be csv or json")
    finally:
        if out:
            f.close()
    if out:
        typer.echo(f"{len(rows)} rows → {out}", err=True)
