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
limit = typer.Typer(help="Request, token and concurrency limits (docs/operations/limits.md).", no_args_is_help=True)
budget = typer.Typer(help="Budgets in tokens or money, per day, week, month or in total.", no_args_is_help=True)
price = typer.Typer(help="What each model's tokens cost (budgets in money, usage spend).", no_args_is_help=True)
policy = typer.Typer(help="The active scheduling policy of every gateway on this database.", no_args_is_help=True)
for name, sub in (("app", apps), ("user", users), ("key", keys), ("weight", weight), ("limit", limit),
                  ("budget", budget), ("price", price), ("policy", policy)):
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


KeyTarget = typer.Option(None, "--key", help="An API key (its id or prefix) instead of --app/--user.")
MAX = {"rpm": 10**9, "tpm": 10**12, "concurrency": 10**6, "tokens": 10**15, "usd": 10**9}


def _bounded(name: str, value, most) -> None:
    if value is not None and not (0 <= value <= most):
        fail(f"--{name} must be between 0 and {most:g} (0 removes it): {value}")


def _quota_target(user: str | None, app: str | None, key: str | None) -> None:
    if key is not None and (user or app):
        fail("give --key alone, or --app/--user")
    if key is None and not (user or app):
        fail("give --app A, --app A --user U, --user U or --key KEY")
    if key is not None and not (key.isdigit() and len(key) <= 18 or 0 < len(key) <= 16 and key.isprintable()):
        fail("--key is a key's id or its prefix (as `admin key list` shows them)")


@limit.command("set")
def limit_set(rpm: int = typer.Option(None, "--rpm", help="Requests per minute."),
              tpm: int = typer.Option(None, "--tpm", help="Tokens per minute (counted as --tpm-kind says)."),
              tpm_kind: str = typer.Option(None, "--tpm-kind", help="What a token limit counts: total (input + "
                                           "output, as OpenAI counts; the default), input, output, or weighted "
                                           "(the cost function's h(input, output))."),
              concurrency: int = typer.Option(None, "--concurrency", help="Requests in flight at once."),
              user: str = UserTarget, app: str = AppTarget, key: str = KeyTarget,
              json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Limit an app, a user or a key: requests and tokens per minute, requests in flight; held under every policy
    and across replicas (429 with retry-after beyond; 0 removes a limit). Running gateways apply it within seconds."""
    from fairgate.quota.quota_admin import TPM_KINDS, set_quota

    _quota_target(user, app, key)
    values = {k: v for k, v in (("rpm", rpm), ("tpm", tpm), ("concurrency", concurrency)) if v is not None}
    for k, v in values.items():
        _bounded(k, v, MAX[k])
    if tpm_kind is not None:
        if tpm_kind not in TPM_KINDS:
            fail(f"--tpm-kind is one of {', '.join(TPM_KINDS)}")
        values["tpm_kind"] = tpm_kind
    if not values:
        fail("give at least one of --rpm, --tpm, --tpm-kind, --concurrency")
    emit(run_admin(db, actor, lambda a: set_quota(a, app, user, key, **values)), json_)


@limit.command("show")
def limit_show(json_: bool = JsonOption, db: str = DatabaseOption):
    """Every app, user and key with a limit or a budget."""
    from fairgate.quota.quota_admin import quotas

    emit(run_admin(db, "cli", quotas), json_, ["target", "rpm", "tpm", "tpm_kind", "concurrency", "budget_tokens",
                                               "budget_usd", "budget_period"])


@limit.command("clear")
def limit_clear(user: str = UserTarget, app: str = AppTarget, key: str = KeyTarget, json_: bool = JsonOption,
                db: str = DatabaseOption, actor: str = ActorOption):
    """Remove an app's, a user's or a key's limits (its budget stays: `admin budget clear`)."""
    from fairgate.quota.quota_admin import clear_quota

    _quota_target(user, app, key)
    emit(run_admin(db, actor, lambda a: clear_quota(a, app, user, key, budget=False)), json_)


@budget.command("set")
def budget_set(tokens: int = typer.Option(None, "--tokens", help="Tokens (input + output) per period."),
               usd: float = typer.Option(None, "--usd", help="US dollars per period (at `admin price set`'s prices)."),
               period: str = typer.Option("month", "--period", help="day, week (from Monday), month (calendar, "
                                          "in budget_timezone) or total."),
               user: str = UserTarget, app: str = AppTarget, key: str = KeyTarget,
               json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """Give an app, a user or a key a budget: beyond it, 429 insufficient_quota until its period turns."""
    import math

    from fairgate.quota.quota_admin import PERIODS, set_quota

    _quota_target(user, app, key)
    if tokens is None and usd is None:
        fail("give --tokens N or --usd X")
    _bounded("tokens", tokens, MAX["tokens"])
    if usd is not None and not math.isfinite(usd):
        fail("--usd must be a finite number")
    _bounded("usd", usd, MAX["usd"])
    if period not in PERIODS:
        fail(f"--period is one of {', '.join(PERIODS)}")
    values = {"budget_period": period, **({"budget_tokens": tokens} if tokens is not None else {}),
              **({"budget_usd": usd} if usd is not None else {})}
    emit(run_admin(db, actor, lambda a: set_quota(a, app, user, key, **values)), json_)


@budget.command("show")
def budget_show(json_: bool = JsonOption, db: str = DatabaseOption):
    """Every app, user and key with a limit or a budget (as `admin limit show`)."""
    limit_show(json_, db)


@budget.command("clear")
def budget_clear(user: str = UserTarget, app: str = AppTarget, key: str = KeyTarget, json_: bool = JsonOption,
                 db: str = DatabaseOption, actor: str = ActorOption):
    """Remove an app's, a user's or a key's budget."""
    from fairgate.quota.quota_admin import clear_quota

    _quota_target(user, app, key)
    emit(run_admin(db, actor, lambda a: clear_quota(a, app, user, key, budget=True)), json_)


@price.command("set")
def price_set(model: str = typer.Argument(..., help="The model, as clients name it."),
              input_: float = typer.Option(..., "--input", help="USD per million input tokens."),
              output: float = typer.Option(..., "--output", help="USD per million output tokens."),
              cached: float = typer.Option(None, "--cached", help="USD per million cached input tokens "
                                           "(default: as --input)."),
              json_: bool = JsonOption, db: str = DatabaseOption, actor: str = ActorOption):
    """What a model's tokens cost: budgets in money and `fairgate usage spend` read it."""
    import math

    from fairgate.quota.quota_admin import set_price

    for name, v in (("input", input_), ("output", output), ("cached", cached)):
        if v is not None and not (math.isfinite(v) and 0 <= v <= 1e6):
            fail(f"--{name} must be between 0 and 1e6 USD per million tokens: {v}")
    if not model or len(model) > 256:
        fail("a model name is 1-256 characters")
    emit(run_admin(db, actor, lambda a: set_price(a, model, input_, output, cached)), json_)


@price.command("show")
def price_show(json_: bool = JsonOption, db: str = DatabaseOption):
    """Every model's prices."""
    from fairgate.quota.quota_admin import prices

    emit(run_admin(db, "cli", prices), json_, ["model", "input", "output", "cached", "updated_at"])


@price.command("clear")
def price_clear(model: str = typer.Argument(..., help="The model."), json_: bool = JsonOption,
                db: str = DatabaseOption, actor: str = ActorOption):
    """Remove a model's prices (its tokens then cost nothing against a budget in money)."""
    from fairgate.quota.quota_admin import clear_price

    emit(run_admin(db, actor, lambda a: clear_price(a, model)), json_)


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
