"""The `fairgate` command."""

from __future__ import annotations

import asyncio
import logging
import sys
from enum import Enum

import typer

from fairgate import __version__
from fairgate.cli.admin import admin
from fairgate.cli.common import DatabaseOption, database_url, fail
from fairgate.cli.plan import plan
from fairgate.cli.replay import replay_command
from fairgate.cli.simulate import simulate
from fairgate.cli.usage import usage
from fairgate.logs import FORMATS
from fairgate.logs import configure as configure_logs
from fairgate.proxy.config import PLACEMENTS, POLICIES, GatewayConfig

app = typer.Typer(help="fairgate: a fairness-first OpenAI-compatible gateway for pools of vLLM servers.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(admin, name="admin")
app.add_typer(usage, name="usage")
app.command("simulate")(simulate)
app.command("plan")(plan)
app.command("replay")(replay_command)
db = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(db, name="db")
Policy = Enum("Policy", {p: p for p in POLICIES}, type=str)
Placement = Enum("Placement", {p: p for p in PLACEMENTS}, type=str)
FairnessKey = Enum("FairnessKey", {k: k for k in ("user", "app", "key", "app>user")}, type=str)
LogFormat = Enum("LogFormat", {f: f for f in FORMATS}, type=str)
D = GatewayConfig  # the embedded defaults, quoted in the help


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fairgate {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(version: bool = typer.Option(False, "--version", help="Print the version and exit.",
                                              callback=_version, is_eager=True)) -> None:
    """fairgate: a fairness-first OpenAI-compatible gateway for pools of vLLM servers."""


def _value(choice: Enum | None) -> str | None:
    return None if choice is None else choice.value


@app.command()
def serve(config: str = typer.Option(None, "--config", help="YAML config file (default $FAIRGATE_CONFIG); "
                                     "flags override it, settings stored with `fairgate admin` override both."),
          host: str = typer.Option(None, "--host", help=f"Listen address (default: {D.host})."),
          port: int = typer.Option(None, "--port", help=f"Listen port (default: {D.port})."),
          policy: Policy = typer.Option(None, "--policy", help=f"Scheduling policy (default: {D.policy})."),
          placement: Placement = typer.Option(None, "--placement", help="Which backend a request goes to "
                                              f"(default: {D.placement})."),
          fairness_key: FairnessKey = typer.Option(None, "--fairness-key", help="Who shares fairly: user, app, "
                                                   "key, or app>user (apps by weight, then users within each "
                                                   f"app) (default: {D.fairness_key})."),
          backend: list[str] = typer.Option(None, "--backend", help="vLLM base URL; repeat for a pool "
                                            "(default: two emulated backends in-process)."),
          database: str = DatabaseOption,
          redis_url: str = typer.Option(None, "--redis-url", help="State shared by replicas (counters, limits): "
                                        "redis://HOST:PORT/DB (one server) or redis+cluster://HOST:PORT[,HOST:PORT…] "
                                        "(Redis Cluster) (default: $FAIRGATE_REDIS_URL, else none: in memory)."),
          speed: float = typer.Option(None, "--speed", help="Speed factor of the emulated backends (default: 1)."),
          log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
          log_format: LogFormat = typer.Option(None, "--log-format", help="text or json (JSON lines) "
                                               f"(default: $FAIRGATE_LOG_FORMAT, else {D.log_format})."),
          workers: int = typer.Option(1, "--workers", help="Gateway processes sharing the port (SO_REUSEPORT), "
                                      "fair across each other through Redis (--redis-url); ~one per core."),
          reuse_port: bool = typer.Option(False, "--reuse-port", hidden=True),
          worker_index: int = typer.Option(0, "--worker-index", hidden=True)):
    """Run the gateway."""
    import uvloop

    from fairgate.proxy import listener
    from fairgate.proxy.config import ConfigError, load_config
    from fairgate.storage.db import SchemaBehind, ensure_schema, make_engine

    try:
        cfg = load_config(config, host=host, port=port, policy=_value(policy), placement=_value(placement),
                          fairness_key=_value(fairness_key), backends=list(backend or []) or None,
                          database_url=database, redis_url=redis_url, log_format=_value(log_format))
    except ConfigError as e:
        fail(str(e))
    if cfg.ops_port is not None:
        from fairgate.proxy.control.console import missing_assets

        if missing := missing_assets():
            fail(f"the console's files are missing from this installation ({', '.join(missing)}): reinstall "
                 "fairgate with its package data, or leave ops_port unset")
    configure_logs(log_level, cfg.log_format, cfg.access_log)
    if speed is not None:
        cfg.emulated.speed = speed
    cfg.worker = worker_index
    if workers < 1:
        fail("--workers must be at least 1")
    if workers > 1:
        if not cfg.backends:
            fail("--workers needs the backends named (--backend or backends:): each worker would start its own "
                 "emulated pool")
        if not cfg.redis_url:
            fail("--workers needs --redis-url: the workers are replicas, fair across each other through Redis")

    async def check() -> None:
        engine = make_engine(cfg.database_url)
        try:
            await ensure_schema(engine)
        finally:
            await engine.dispose()

    try:
        asyncio.run(check())
    except SchemaBehind as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot reach the database: {e}")
    if workers > 1:
        from fairgate.cli.workers import supervise

        argv = [a for a in sys.argv[2:]]
        i = next(k for k, a in enumerate(argv) if a == "--workers" or a.startswith("--workers="))
        del argv[i:i + (1 if "=" in argv[i] else 2)]
        raise typer.Exit(supervise(argv, workers))
    logging.getLogger("fairgate").info("configured policy %s (%s), placement %s (%s)%s", cfg.policy,
                                       cfg.source("policy"), cfg.placement, cfg.source("placement"),
                                       f", worker {worker_index}" if reuse_port else "")
    uvloop.run(listener.serve(cfg, cfg.host, cfg.port, reuse_port=reuse_port))


@app.command("backend-sim")
def backend_sim(port: int = typer.Option(..., "--port", help="Listen port."),
                host: str = typer.Option("127.0.0.1", "--host", help="Listen address."),
                model: str = typer.Option("sim-llama", "--model", help="The model name it serves."),
                profile: str = typer.Option("a10g-llama2-7b", "--profile", help="Engine profile: its prefill, "
                                            "decode and KV figures (fairgate/engine/profiles.py)."),
                speed: float = typer.Option(1.0, "--speed", help="x times faster than the profile's real time."),
                kv_tokens: int = typer.Option(None, "--kv-tokens", help="KV cache capacity in tokens (default: "
                                              "the profile's)."),
                max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Most sequences in a batch "
                                                 "(default: the profile's)."),
                mean_output: int = typer.Option(128, "--mean-output", help="Mean output length without ignore_eos."),
                admission: str = typer.Option("future", "--admission", help="future: admit a request when its "
                                              "whole future fits (never preempts); vllm: when its prompt fits "
                                              "now, preempting as vLLM v1 does."),
                log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error.")):
    """An emulated vLLM OpenAI server (engine model + vLLM's API and metrics)."""
    import uvloop

    from fairgate.engine.serve import start_emulator

    configure_logs(log_level, "text")

    async def main() -> None:
        emu = await start_emulator(host=host, port=port, model=model, profile=profile, speed=speed,
                                   kv_tokens=kv_tokens, max_num_seqs=max_num_seqs, mean_output=mean_output,
                                   admission=admission)
        print(f"emulated vLLM ({profile}, speed {speed}) serving {model} on {emu.url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await emu.stop()

    try:
        uvloop.run(main())
    except KeyboardInterrupt:
        pass


@db.command("upgrade")
def db_upgrade(database: str = DatabaseOption):
    """Apply the schema migrations up to this version's head."""
    from fairgate.storage.db import make_engine, upgrade

    async def main() -> str:
        engine = make_engine(database_url(database))
        try:
            return await upgrade(engine)
        finally:
            await engine.dispose()

    typer.echo(f"database at revision {asyncio.run(main())}")


def command():
    """The click command behind ``app``, its help tidied: flags show no placeholder, values a plain one
    (TEXT, INT, FLOAT, PATH); choices stay listed."""
    cmd = typer.main.get_command(app)
    _tidy(cmd)
    return cmd


def _tidy(cmd) -> None:
    made = cmd.get_help_option

    def help_option(ctx):
        option = made(ctx)
        if option is not None:
            option.metavar = ""
        return option

    cmd.get_help_option = help_option
    for param in cmd.params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
        elif param.metavar is not None:
            continue
        elif param.type_descriptor.is_choice:
            param.metavar = "[" + "|".join(str(getattr(c, "value", c)) for c in param.type_descriptor.choices) + "]"
        elif param.param_type_name == "argument":
            param.metavar = param.name.upper()
            param.display_type_rich = lambda ctx: None  # its help says what it is: no <str> beside it
        else:
            kind = param.bare_type().removeprefix("list[").removesuffix("]")
            param.metavar = {"int": "INT", "float": "FLOAT", "str": "TEXT", "Path": "PATH"}.get(kind)
    for sub in getattr(cmd, "commands", {}).values():
        _tidy(sub)


def main() -> None:
    command()(prog_name="fairgate")


if __name__ == "__main__":
    main()
