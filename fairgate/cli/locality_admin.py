"""`fairgate admin locality …`: DLPM's and D²LPM's parameters, applied live by running gateways (audited)."""

from __future__ import annotations

import typer

from fairgate.cli.common import ActorOption, DatabaseOption, JsonOption, emit, fail, with_db
from fairgate.cli.live import ConfigOption, show, unset
from fairgate.proxy.config import PLACEMENTS, LOCALITY_SETTINGS as FIELDS, locality_error as check
from fairgate.storage.identity import Admin

locality = typer.Typer(help="Locality (dlpm, lpm; placements prefix, d2lpm, aladdin): quanta, window, match "
                       "ratio, aladdin's gamma, theta and packing.",
                       no_args_is_help=True)


@locality.command("set")
def locality_set(quantum: float = typer.Option(None, "--quantum", help="DLPM's Q^u per client and backend."),
                 client_quantum: float = typer.Option(None, "--client-quantum", help="D²LPM's Q^w per client × "
                                                      "backend."),
                 window: int = typer.Option(None, "--window", help="A client's waiting requests DLPM compares."),
                 ratio: float = typer.Option(None, "--ratio", help="`prefix` placement: exploit a match longer "
                                             "than this share of the prompt."),
                 gamma: float = typer.Option(None, "--gamma", help="`aladdin`: the weight of a predicted output "
                                             "in the ATGT budget (0-1)."),
                 theta: float = typer.Option(None, "--theta", help="`aladdin`: the share of its budgets a "
                                             "backend may use."),
                 pack: int = typer.Option(None, "--pack", help="`aladdin`: 1 for the paper's best fit, 0 for the "
                                          "least full feasible backend."),
                 json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Change the locality parameters; running gateways apply them within seconds."""
    given = {k: v for k, v in zip(FIELDS, (quantum, client_quantum, window, ratio, gamma, theta, pack))
             if v is not None}
    if not given:
        fail("nothing to set")
    for k, v in given.items():
        if (why := check(k, v)) is not None:
            fail(why)

    async def run(admin: Admin):
        for k, v in given.items():
            await admin.set_setting(f"locality.{k}", str(v))
        return given

    emit(with_db(db, lambda sessions: run(Admin(sessions, actor))), json_)


@locality.command("show")
def locality_show(config: str = ConfigOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """The locality parameters and placement in force, and where each comes from."""
    show(("placement", *(f"locality.{k}" for k in FIELDS)), config, db, json_, "locality")


@locality.command("unset")
def locality_unset(fields: list[str] = typer.Argument(None, help=f"Of {', '.join(FIELDS)} and placement; "
                                                      "none: all of them."),
                   json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Remove parameters set with `locality set` (or the placement): gateways return to their configuration."""
    unset(fields, {**{k: f"locality.{k}" for k in FIELDS}, "placement": "placement"}, "locality", db, actor, json_)


@locality.command("placement")
def placement_set(name: str = typer.Argument(None, help=f"{', '.join(PLACEMENTS)}; none: show the one "
                                              "in force"),
                  config: str = ConfigOption, json_: bool = JsonOption, db: str = DatabaseOption,
                  actor: str = ActorOption):
    """Switch the placement; running gateways apply it within seconds (waiting requests are routed again)."""
    if name is None:
        show(("placement",), config, db, json_, "placement")
        return
    if name not in PLACEMENTS:
        fail(f"unknown placement {name!r}; the gateway runs {', '.join(PLACEMENTS)}")
    emit(with_db(db, lambda sessions: Admin(sessions, actor).set_setting("placement", name)), json_)
