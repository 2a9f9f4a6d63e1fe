"""`fairgate admin`: apps, users, keys, weights and limits. Every change is audited."""

from __future__ import annotations

import typer

from fairgate.cli.backends_admin import backends
from fairgate.cli.common import ActorOption, DatabaseOption, JsonOption, emit, fail, run_admin
from fairgate.cli.fairserve_admin import fairserve, stats
from fairgate.cli.live import ConfigOption, show, unset
from fairgate.cli.locality_admin import locality
from fairgate.cli.slo_admin import slo

admin = typer.Typer(help="Manage apps, users, keys, weights and limits (each change audited).", no_args_is_help=True)
apps = typer.Typer(help="Apps.", no_args_is_help=True)
users = typer.Typer(help="Users.", no_args_is_help=True)
keys = typer.Typer(help="API keys (stored hashed; a new key is shown once).", no_args_is_help=True)
weight = typer.Typer(help="Fair-share weights.", no_args_is_help=True)
limit = typer.Typer(help="Request-rate limits.", no_args_is_help=True)
policy = typer.Typer(help="The active scheduling policy of every gateway on this database.", no_args_is_help=True)
for name, sub in (("app", apps), ("user", users), ("key", keys), ("weight", weight), ("limit", limit),
                  ("policy", policy)):
    admin.add_typer(sub, name=name)
admin.add_typer(fairserve, name="fairserve")
admin.add_typer(stats, name="stats")
admin.add_typer(locality, name="locality")
admin.add_typer(slo, name="slo")
admin.command("backends")(backends)



AppOfUser = typer.Option(None, "--app", help="For a user: the app it belongs to (if several have that name).")
WeightOption = typer.Option(1.0, "--weight", help="Fair-share weight: twice the weight, twice the service when "
                            "both are backlogged.")
RpmOption = typer.Option(None, "--rpm", help="Requests per minute, held under every policy (default: no limit).")
UserTarget = typer.Option(None, "--user", help="The user (with --app: that app's user, created if new).")
AppTarget = typer.Option(None, "--app", help="The app (alone), or the app of --user.")
NameArgument = typer.Argument(..., help="Its name: 1-128 printable characters.")
FIELDS_HELP = ("Guarded fields: chat_template, chat_template_kwargs, kv_transfer_params, priority, "
               "mm_processor_kwargs, logits_processors, vllm_xargs, request_id, remote_media; and slo-headers "
               "(the x-slo-ttft-ms / x-slo-tpot-ms request headers).")


@apps.command("create")
def app_create(name: str = NameArgument, weight_: float = WeightOption, rpm: int = RpmOption,
               json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Create an app: a tenant whose keys, users and usage are its own."""
    emit(run_admin(db, actor, lambda a: a.create_app(name, weight_, rpm)), json_)


@apps.command("allow")
def app_allow(app: str = typer.Argument(..., help="The app."),
              fields: list[str] = typer.Argument(..., help=FIELDS_HELP),
              json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Let an app's requests carry guarded body fields to the backend (refused with a 400 otherwise)."""
    emit(run_admin(db, actor, lambda a: a.allow_fields(app, fields)), json_)


@apps.command("disallow")
def app_disallow(app: str = typer.Argument(..., help="The app."),
                 fields: list[str] = typer.Argument(..., help=FIELDS_HELP), json_: bool = JsonOption,
                 db: str = DatabaseOption, actor: str = ActorOption):
    """Stop an app forwarding guarded body fields it was allowed."""
    emit(run_admin(db, actor, lambda a: a.allow_fields(app, [], fields)), json_)


@users.command("create")
def user_create(name: str = NameArgument,
                app: str = typer.Option(None, "--app", help="The app the user belongs to."),
                shared: bool = typer.Option(False, "--shared", help="A user every app may name (no --app)."),
                weight_: float = WeightOption, rpm: int = RpmOption,
                json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """A user of one app (the same name in another app is another user), or with --shared one user that
    every app's keys may name."""
    if bool(app) == shared:
        fail("give --app A (a user of that app) or --shared (a user every app may name)")
    emit(run_admin(db, actor, lambda a: a.create_user(name, app, weight_, rpm)), json_)


@keys.command("create")
def key_create(app: str = typer.Option(..., "--app", help="The app the key belongs to."),
               user: str = typer.Option(None, "--user", help="Bind the key to this user of the app (else the "
                                        "caller names its users per request)."),
               name: str = typer.Option(None, "--name", help="A label, to tell keys apart in `key list`."),
               json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Create a key for an app (and optionally a user). The key is printed once and never stored."""
    out = run_admin(db, actor, lambda a: a.create_key(app, user, name))
    emit(out, json_)
    if not json_:
        typer.echo("Store this key now: it cannot be shown again.", err=True)


def _lister(sub: typer.Typer, what: str, columns: list[str]):
    @sub.command("list", help=f"List the {what}.")
    def _list(json_: bool = JsonOption, db: str = DatabaseOption):
        emit(run_admin(db, "cli", lambda a: a.list(what)), json_, columns, title=what)


def _toggler(sub: typer.Typer, what: str):
    ident_help = "The key's id or prefix." if what == "key" else f"The {what}'s name."
    Ident = typer.Argument(..., help=ident_help)  # noqa: N806

    @sub.command("disable", help=f"Disable a {what}: its requests are refused with 401 or 403 within seconds.")
    def _disable(ident: str = Ident, app: str = AppOfUser, json_: bool = JsonOption, db: str = DatabaseOption,
                 actor: str = ActorOption):
        emit(run_admin(db, actor, lambda a: a.set_disabled(what, ident, True, app)), json_)

    @sub.command("enable", help=f"Enable a {what} again.")
    def _enable(ident: str = Ident, app: str = AppOfUser, json_: bool = JsonOption, db: str = DatabaseOption,
                actor: str = ActorOption):
        emit(run_admin(db, actor, lambda a: a.set_disabled(what, ident, False, app)), json_)


_lister(apps, "apps", ["id", "name", "weight", "rpm_limit", "disabled", "created_at"])
_lister(users, "users", ["id", "app", "name", "weight", "rpm_limit", "disabled", "created_at"])
_lister(keys, "keys", ["id", "prefix", "name", "app", "user", "disabled", "created_at"])
for _what, _sub in (("app", apps), ("user", users), ("key", keys)):
    _toggler(_sub, _what)


def _target(user: str | None, app: str | None) -> tuple[str, str, str | None]:
    """``--app A``: the app; ``--user U --app A``: A's user U (created if new); ``--user U``: the shared
    user U, or the one app's user of that name."""
    if not user and not app:
        fail("give --app A, --user U --app A, or --user U")
    return ("user", user, app) if user else ("app", app, None)  # type: ignore[return-value]


@weight.command("set")
def weight_set(value: float = typer.Argument(..., help="The weight (> 0)."), user: str = UserTarget,
               app: str = AppTarget, json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Set an app's or a user's fair-share weight; running gateways apply it within seconds."""
    if value <= 0:
        fail("a weight must be positive")
    what, name, of = _target(user, app)
    emit(run_admin(db, actor, lambda a: a.set_field(what, name, "weight", value, of)), json_)


@limit.command("set")
def limit_set(rpm: int = typer.Option(..., "--rpm", help="Requests per minute; 0 removes the limit."),
              user: str = UserTarget, app: str = AppTarget,
              json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Limit an app's or a user's requests per minute, under every policy (429 with retry-after beyond)."""
    if rpm < 0:
        fail("--rpm must be ≥ 0")
    what, name, of = _target(user, app)
    emit(run_admin(db, actor, lambda a: a.set_field(what, name, "rpm_limit", rpm or None, of)), json_)


@admin.command("audit")
def audit(limit_: int = typer.Option(50, "--limit", help="At most this many changes, newest first."), json_: bool = JsonOption, db: str = DatabaseOption):
    """The latest admin changes: who, what, before, after, when."""
    emit(run_admin(db, "cli", lambda a: a.audit_log(limit_)), json_,
         ["id", "at", "actor", "action", "target", "before", "after"])


@policy.command("set")
def policy_set(name: str = typer.Argument(..., help="fcfs, rpm, lcf, vtc, vtc-predict, wsc, fairserve, lpm or dlpm"),
               json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Switch the policy; running gateways apply it within seconds, keeping their queues and counters."""
    from fairgate.policies.factory import LIVE_POLICIES

    if name not in LIVE_POLICIES:
        fail(f"unknown or simulator-only policy {name!r}; the gateway runs {', '.join(LIVE_POLICIES)}")
    emit(run_admin(db, actor, lambda a: a.set_setting("policy", name)), json_)


@policy.command("show")
def policy_show(config: str = ConfigOption, json_: bool = JsonOption, db: str = DatabaseOption):
    """The policy and placement in force, and where each comes from (default, file, environment, database)."""
    show(("policy", "placement"), config, db, json_, "scheduling policy")


@policy.command("unset")
def policy_unset(json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Remove the policy set with `policy set`: running gateways return to their --policy or config file."""
    unset(None, {"policy": "policy"}, "policy", db, actor, json_)
