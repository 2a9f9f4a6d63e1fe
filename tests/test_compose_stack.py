"""The deployment as a platform team runs it: the project's image built from its `Dockerfile`, and
`docker-compose.yml` brought up with its real dependencies — PostgreSQL, Redis, the migration job, two emulated
vLLM backends, two gateway replicas and Prometheus — on stand-ins for the images no registry can be pulled
from here (tests/docker_stack.py, tests/stand-ins/). Grafana has no stand-in: its service is left out, and the
test says so in a warning.

`make test-deploy` runs it (CI after `make test`); the first run installs Docker from Debian's packages and
builds the stand-ins (minutes), later runs reuse them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import time
import urllib.request
import warnings

import asyncpg
import pytest
from openai import OpenAI

from tests import docker_stack as ds

pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600)]
PROJECT = "fairgate-deploy-test"
OPS_TOKEN = "change-me-ops-token"  # docker-compose.yml's (and deploy/prometheus/prometheus.yaml's)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def _until(what: str, check, timeout: float = 180.0, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


class Stack:
    """`docker compose -p PROJECT` over the repository's compose file, with its published ports moved to free
    ones (the machine runs its own PostgreSQL and Redis on the defaults)."""

    def __init__(self):
        self.compose = ds.compose_command()
        self.ports = {name: _free_port() for name in ("POSTGRES_PORT", "REDIS_PORT", "GATEWAY_1_PORT",
                                                      "GATEWAY_2_PORT", "GATEWAY_1_OPS_PORT", "GATEWAY_2_OPS_PORT",
                                                      "PROMETHEUS_PORT", "GRAFANA_PORT")}

    def _argv(self, *args: str) -> list[str]:
        return [*self.compose, "-p", PROJECT, "-f", str(ds.ROOT / "docker-compose.yml"), *args]

    def _env(self) -> dict[str, str]:
        return {**os.environ, **{k: str(v) for k, v in self.ports.items()}}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return ds.run(*self._argv(*args), timeout=timeout, check=check, cwd=ds.ROOT, env=self._env())

    def start(self, *args: str) -> subprocess.Popen:
        """A compose command left running (``wait`` on it)."""
        return subprocess.Popen(self._argv(*args), cwd=ds.ROOT, env=self._env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).stdout.strip()

    def state(self, service: str) -> tuple[str, int]:
        out = ds.run("docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", self.container(service))
        status, code = out.stdout.split()
        return status, int(code)

    def health(self, service: str) -> str:
        return ds.run("docker", "inspect", "-f", "{{.State.Health.Status}}", self.container(service)).stdout.strip()

    def url(self, replica: int, ops: bool = False) -> str:
        name = f"GATEWAY_{replica}_OPS_PORT" if ops else f"GATEWAY_{replica}_PORT"
        return f"http://127.0.0.1:{self.ports[name]}"

    def logs(self, service: str, lines: int = 40) -> str:
        return self("logs", "--no-color", "--tail", str(lines), service, check=False).stdout

    def wait(self, service: str, what: str, check, timeout: float = 180.0, exits: bool = False):
        """``check()``'s first true answer; past ``timeout``, or as soon as ``service`` has exited (unless it
        ``exits`` by design), a failure naming it, with its log."""
        def probe():
            if not exits and self.state(service)[0] in ("exited", "dead"):
                raise AssertionError(f"{service} exited {self.state(service)[1]} while waiting for {what}")
            return check()
        try:
            return _until(f"{service}: {what}", probe, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- the last lines {service} wrote:\n{self.logs(service)}") from None

    def admin(self, *args: str) -> str:
        return self("exec", "-T", "gateway-1", "fairgate", "admin", *args).stdout


def _left(project: str) -> list[str]:
    """Containers and networks of ``project`` that still exist."""
    label = f"label=com.docker.compose.project={project}"
    return (ds.run("docker", "ps", "-aq", "--filter", label).stdout.split()
            + ds.run("docker", "network", "ls", "-q", "--filter", label).stdout.split())


def _counter(metrics: bytes, tenant: str) -> float | None:
    m = re.search(rb'^fairgate_tenant_counter\{tenant="' + re.escape(tenant.encode()) + rb'"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else None


@pytest.fixture(scope="module")
def stack():
    ds.install_packages()
    with ds.daemon():
        built = ds.stand_ins()
        ds.build_image()
        print(f"\nstand-ins built now: {built or 'none (cached)'}; {ds.IMAGE} is {ds.image_size_mb():.0f} MB")
        names = {s: spec["image"] for s, spec in _compose_services().items()}
        services = [s for s, image in names.items() if image not in ds.LEFT_OUT]
        for s, image in names.items():
            if image in ds.LEFT_OUT:
                warnings.warn(f"docker-compose.yml's {s} ({image}) is left out: {ds.LEFT_OUT[image]}")
        st = Stack()
        st("down", "-v", "--remove-orphans", check=False)
        try:
            st("up", "-d", "--no-build", *services)
            yield st
        finally:
            logs = st("logs", "--no-color", "--tail", "60", check=False).stdout
            st("down", "-v", "--remove-orphans", "-t", "40", check=False)
            print(logs[-6000:])


def _compose_services() -> dict:
    import yaml

    return yaml.safe_load((ds.ROOT / "docker-compose.yml").read_text())["services"]


def test_every_image_the_files_name_is_built_here_or_left_out_by_name():
    named = {spec["image"] for spec in _compose_services().values()}
    named.add(re.search(r"^FROM (\S+)", (ds.ROOT / "Dockerfile").read_text(), re.M).group(1))
    assert named - {ds.IMAGE} == set(ds.STAND_INS) | set(ds.LEFT_OUT)


def test_the_image_runs_unprivileged_without_test_tools(stack):
    uid = ds.run("docker", "run", "--rm", ds.IMAGE, "id", "-u").stdout.strip()
    assert uid != "0"
    probe = ("import importlib.util as u; "
             "print([m for m in ('pytest', 'mkdocs', 'playwright', 'hypothesis') if u.find_spec(m)])")
    assert ds.run("docker", "run", "--rm", ds.IMAGE, "python", "-c", probe).stdout.strip() == "[]"
    health = json.loads(ds.run("docker", "image", "inspect", "-f", "{{json .Config.Healthcheck}}", ds.IMAGE).stdout)
    assert "/ready" in " ".join(health["Test"])


def test_the_stack_serves_through_both_replicas_shares_fairness_and_keeps_every_row(stack):
    # the migration job ran to completion, then both replicas came up ready and healthy
    stack.wait("migrate", "the migration job to exit 0", lambda: stack.state("migrate") == ("exited", 0), exits=True)
    for replica in (1, 2):
        stack.wait(f"gateway-{replica}", "/ready to answer 200", lambda: _get(stack.url(replica) + "/ready")[0] == 200)
    for service in ("gateway-1", "gateway-2", "backend-1", "backend-2"):
        stack.wait(service, "docker's health check to pass", lambda: stack.health(service) == "healthy", timeout=120)

    stack.admin("app", "create", "alpha")
    stack.admin("app", "create", "beta")
    keys = {app: json.loads(stack.admin("key", "create", "--app", app, "--json"))["key"] for app in ("alpha", "beta")}
    clients = {(app, r): OpenAI(base_url=stack.url(r) + "/v1", api_key=keys[app], max_retries=0, timeout=60)
               for app in keys for r in (1, 2)}
    model = clients["alpha", 1].models.list().data[0].id
    sent = 0

    def ask(app: str, replica: int) -> None:
        nonlocal sent
        out = clients[app, replica].chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8)
        sent += 1
        assert out.usage.completion_tokens == 8 and out.choices[0].message.content

    for replica in (1, 2):  # a client through each replica is served
        ask("beta", replica)
    for _ in range(6):  # alpha's service through replica 1 only ...
        ask("alpha", 1)
    ask("alpha", 2)  # ... is in its virtual counter on replica 2, through Redis

    def counters():
        got = [_counter(_get(stack.url(r, ops=True) + "/metrics", OPS_TOKEN)[1], "app:alpha") for r in (1, 2)]
        return got if None not in got and got[1] >= 0.9 * got[0] > 0 else None
    c1, c2 = stack.wait("gateway-2", "alpha's counter from gateway-1, through Redis", counters, timeout=30)
    print(f"alpha's virtual counter: replica 1 {c1:.0f}, replica 2 {c2:.0f}")

    async def rows() -> int:
        conn = await asyncpg.connect(f"postgresql://fairgate:fairgate@127.0.0.1:{stack.ports['POSTGRES_PORT']}"
                                     "/fairgate")
        try:
            return await conn.fetchval("SELECT count(*) FROM usage_log WHERE status = 'ok'")
        finally:
            await conn.close()
    stack.wait("postgres", "every request's row", lambda: asyncio.run(rows()) == sent, timeout=30)

    # Prometheus scrapes both replicas with the operations token
    def targets():
        status, body = _get(f"http://127.0.0.1:{stack.ports['PROMETHEUS_PORT']}/api/v1/targets")
        up = [t for t in json.loads(body)["data"]["activeTargets"] if t["health"] == "up"] if status == 200 else []
        return len(up) == 2 and up
    up = stack.wait("prometheus", "both replicas scraped", targets, timeout=90)
    assert {t["labels"]["instance"] for t in up} == {"gateway-1:9100", "gateway-2:9100"}

    # the console, on each replica's operations port, behind the token
    for replica in (1, 2):
        ops, name = stack.url(replica, ops=True), f"gateway-{replica}"
        assert _get(ops + "/console/events")[0] == 401, name
        status, page = _get(ops + "/console", OPS_TOKEN)
        assert status == 200 and b"<html" in page.lower(), f"{name}: /console answered {status} {page[:300]!r}"
        for asset in ("console.js", "console.css", "uPlot.iife.min.js"):
            status, body = _get(f"{ops}/console/{asset}", OPS_TOKEN)
            assert status == 200, f"{name}: /console/{asset} answered {status} {body[:300]!r}"
        assert _get(stack.url(replica) + "/console", OPS_TOKEN)[0] == 404, name  # (not on the API port)

    # SIGTERM: a replica drains a stream in flight, then exits cleanly
    stream = clients["beta", 2].chat.completions.create(
        model=model, messages=[{"role": "user", "content": "a long answer"}], max_tokens=120, stream=True,
        extra_body={"ignore_eos": True})
    first = next(iter(stream))
    stopping = stack.start("stop", "gateway-2")  # (docker stop: SIGTERM, then SIGKILL after stop_grace_period)
    chunks = [first, *stream]
    assert stopping.wait(timeout=120) == 0
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) >= 120
    assert stack.state("gateway-2") == ("exited", 0)


def test_down_leaves_nothing_running(stack):
    stack("down", "-v", "--remove-orphans", "-t", "40")
    assert _left(PROJECT) == []
