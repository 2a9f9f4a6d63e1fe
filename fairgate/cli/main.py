"""The `fairgate` command."""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import List

import typer

from fairgate.cli.admin import admin
from fairgate.cli.common import DatabaseOption, database_url, fail
from fairgate.cli.simulate import simulate
from fairgate.cli.usage import usage

app = typer.Typer(help="fairgate: a fairness-first OpenAI-compatible gateway for pools of vLLM servers.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
app.add_typer(admin, name="admin")
app.add_typer(usage, name="usage")
app.command("simulate")(simulate)
db = typer.Typer(help="Database schema.", no_args_is_help=True)
app.add_typer(db, name="db")


def _logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)


@app.command()
def serve(config: str = typer.Option(None, "--config", help="YAML config (default $FAIRGATE_CONFIG)."),
          host: str = typer.Option(None, "--host"), port: int = typer.Option(None, "--port"),
          policy: str = typer.Option(None, "--policy"), placement: str = typer.Option(None, "--placement"),
          fairness_key: str = typer.Option(None, "--fairness-key", help="user (default), app, key, or app>user: "
                                           "apps share by weight, each app's share among its users."),
          backend: List[str] = typer.Option(None, "--backend", help="vLLM base URL; repeat for a pool. "
                                            "None: two emulated backends in-process."),
          database: str = DatabaseOption,
          redis_url: str = typer.Option(None, "--redis-url", help="State shared by replicas: "
                                        "redis://host:port/db (one server) or "
                                        "redis+cluster://host:port[,host:port…] (Redis Cluster)."),
          speed: float = typer.Option(None, "--speed", help="Speed factor of the emulated backends."),
          log_level: str = typer.Option("info", "--log-level"),
          workers: int = typer.Option(1, "--workers", help="Gateway processes sharing the port (SO_REUSEPORT), "
                                      "fair across each other through Redis (--redis-url); ~one per core."),
          reuse_port: bool = typer.Option(False, "--reuse-port", hidden=True),
          worker_index: int = typer.Option(0, "--worker-index", hidden=True)):
    """Run the gateway."""
    import uvloop

    from fairgate.proxy import listener
    from fairgate.proxy.app import Gateway
    from fairgate.proxy.config import ConfigError, load_config
    from fairgate.storage.db import SchemaBehind, ensure_schema, make_engine

    _logging(log_level)
    try:
        cfg = load_config(config, host=host, port=port, policy=policy, placement=placement, fairness_key=fairness_key,
                          backends=list(backend or []) or None, database_url=database, redis_url=redis_url)
    except ConfigError as e:
        fail(str(e))
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
        if cfg.ops_port is not None:
            fail("--workers with ops_port: every worker would bind it; scrape /metrics on the main port instead")

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
    gateway = Gateway(cfg)
    logging.getLogger("fairgate").info("policy %s, placement %s%s", cfg.policy, cfg.placement,
                                       f", worker {worker_index}" if reuse_port else "")
    uvloop.run(listener.serve(gateway, cfg.host, cfg.port, reuse_port=reuse_port))


@app.command("backend-sim")
def backend_sim(port: int = typer.Option(..., "--port"), host: str = typer.Option("127.0.0.1", "--host"),
                model: str = typer.Option("sim-llama", "--model"),
                profile: str = typer.Option("a10g-llama2-7b", "--profile"),
                speed: float = typer.Option(1.0, "--speed", help="x times faster than the profile's real time."),
                kv_tokens: int = typer.Option(None, "--kv-tokens"), max_num_seqs: int = typer.Option(None, "--max-num-seqs"),
                mean_output: int = typer.Option(128, "--mean-output", help="Mean output length without ignore_eos."),
                log_level: str = typer.Option("warning", "--log-level")):
    """An emulated vLLM OpenAI server (engine model + vLLM's API and metrics)."""
    import uvloop

    from fairgate.sim.serve import start_emulator

    _logging(log_level)

    async def main() -> None:
        emu = await start_emulator(host=host, port=port, model=model, profile=profile, speed=speed,
                                   kv_tokens=kv_tokens, max_num_seqs=max_num_seqs, mean_output=mean_output)
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


if __name__ == "__main__":
    app()
