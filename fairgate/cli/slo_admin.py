"""`fairgate admin slo …`: an app's SLO class (targets, band, shedding, minimum share), applied live (audited)."""

from __future__ import annotations

import typer

from fairgate.accounting.slo import BANDS, SloClass, SloError
from fairgate.cli.common import ActorOption, DatabaseOption, JsonOption, emit, fail, run_admin
from fairgate.storage.identity import slo_key

slo = typer.Typer(help="SLO classes: an app's latency targets and priority band.", no_args_is_help=True)
AppOption = typer.Option(..., "--app", help="The app.")


@slo.command("set")
def slo_set(app: str = AppOption,
            name: str = typer.Option(..., "--class", help="The class's name (1-64 letters, digits, '.', '_', '-')."),
            ttft_ms: float = typer.Option(None, "--ttft-ms", help="Time to first token, from arrival (ms)."),
            atgt_ms: float = typer.Option(None, "--atgt-ms", help="Average time per token after the first (ms)."),
            band: str = typer.Option("standard", "--band", help=" | ".join(BANDS) + ", served in that order."),
            sheddable: bool = typer.Option(False, "--sheddable", help="Its requests may be refused rather than "
                                           "served late."),
            min_share: float = typer.Option(None, "--min-share", help="The least share of dispatches its band "
                                            "keeps while it has requests waiting (0 < F < 1)."),
            json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Give an app an SLO class (replacing the one it had); running gateways apply it within seconds."""
    try:
        cls = SloClass(name, ttft_ms, atgt_ms, band, sheddable, min_share)
    except SloError as e:
        fail(str(e))
    emit(run_admin(db, actor, lambda a: a.set_slo(app, cls)), json_)


@slo.command("show")
def slo_show(json_: bool = JsonOption, db: str = DatabaseOption):
    """Every app's SLO class."""
    emit(run_admin(db, "cli", lambda a: a.slo_classes()), json_)


@slo.command("clear")
def slo_clear(app: str = AppOption, json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Remove an app's SLO class: its requests have no targets and are served in the standard band."""
    emit(run_admin(db, actor, lambda a: a.unset_settings([slo_key(app)])), json_)
