"""The `show` and `unset` of the live settings (policy, placement, locality, FairServe): the value in force and
where it comes from — default, file, environment, flag, database (fairgate/proxy/control/settings.py)."""

from __future__ import annotations

import typer

from fairgate.cli.common import emit, fail, with_db
from fairgate.storage.identity import Admin

ConfigOption = typer.Option(None, "--config", help="The gateways' YAML config, to show what the database "
                            "overrides (default $FAIRGATE_CONFIG).")


def show(keys: tuple[str, ...], config: str | None, db: str | None, json_: bool, title: str) -> None:
    """Print each setting's value in force on a gateway started with ``config`` and no flags."""
    from fairgate.proxy.config import ConfigError, load_config
    from fairgate.proxy.control.settings import effective

    try:
        cfg = load_config(config, database_url=db)
    except ConfigError as e:
        fail(str(e))
    stored = with_db(cfg.database_url, lambda sessions: Admin(sessions, "cli").settings())
    rows = effective(cfg, stored, keys)
    emit(rows, json_, ["setting", "value", "source", "configured", "configured_source"], title=title)


def unset(given: list[str] | None, keys: dict[str, str], what: str, db: str | None, actor: str,
          json_: bool) -> None:
    """Remove database settings — ``given`` fields (none: all of ``keys``, field → setting key): running
    gateways return to their configuration within seconds."""
    unknown = sorted(set(given or ()) - set(keys))
    if unknown:
        fail(f"not a {what} setting: {', '.join(unknown)} (known: {', '.join(keys)})")
    chosen = [keys[k] for k in given or keys]
    emit(with_db(db, lambda sessions: Admin(sessions, actor).unset_settings(chosen)), json_)
