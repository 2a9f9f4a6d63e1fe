"""`fairgate admin`, `fairgate usage` and `fairgate db`, run as the real command."""

from __future__ import annotations

import asyncio
import csv
import json
import sqlite3
import subprocess
import sys

import pytest

from tests.conftest import gateway_config, run_gateway


def fg(*args: str, db: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args, "--database-url", db],
                       capture_output=True, text=True, timeout=60)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def fg_json(*args: str, db: str):
    return json.loads(fg(*args, "--json", db=db).stdout)


async def afg_json(*args: str, db: str):
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "fairgate.cli.main", *args, "--json",
                                                "--database-url", db, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


def _inproc(*args: str, db: str, check: bool = True):
    """The command run in this process (typer's runner): the same code as ``fg`` without an interpreter start."""
    from typer.testing import CliRunner

    from fairgate.cli.main import app

    got = CliRunner().invoke(app, [*args, "--database-url", db])
    if check:
        assert got.exit_code == 0, got.output
    crashed = got.exception is not None and not isinstance(got.exception, SystemExit)
    return subprocess.CompletedProcess(args, got.exit_code, got.stdout,  # (as ``fg`` answers)
                                       got.output + (f"\nTraceback: {got.exception!r}" if crashed else ""))


def _inproc_json(*args: str, db: str):
    return json.loads(_inproc(*args, "--json", db=db).stdout)


def test_admin_lifecycle_is_audited(sqlite_url):
    app = fg_json("admin", "app", "create", "chat", db=sqlite_url)
    assert app["name"] == "chat" and app["weight"] == 1.0
    created = _inproc_json("admin", "key", "create", "--app", "chat", "--user", "alice", db=sqlite_url)
    assert created["key"].startswith("fg-") and created["user"] == "alice"
    listed = _inproc_json("admin", "key", "list", db=sqlite_url)
    assert created["key"] not in json.dumps(listed) and "key_hash" not in listed[0]  # shown once, stored hashed
    assert [u["name"] for u in _inproc_json("admin", "user", "list", db=sqlite_url)] == ["alice"]
    changed = _inproc_json("admin", "weight", "set", "--user", "alice", "2.5", db=sqlite_url)
    assert (changed["weight"], changed["app"], "app_id" in changed) == (2.5, "chat", False)  # as `user list`
    assert _inproc_json("admin", "limit", "set", "--app", "chat", "--rpm", "60", db=sqlite_url)["rpm"] == 60
    assert _inproc_json("admin", "app", "disable", "chat", db=sqlite_url)["disabled"] is True
    assert _inproc_json("admin", "policy", "set", "vtc", db=sqlite_url) == {"key": "policy", "value": "vtc"}
    shown = _inproc_json("admin", "policy", "show", db=sqlite_url)
    assert shown[0] == {"setting": "policy", "value": "vtc", "source": "database", "configured": "vtc",
                        "configured_source": "default"}
    assert shown[1] == {"setting": "placement", "value": "least-load", "source": "default"}
    assert _inproc("admin", "policy", "set", "vtc-oracle", db=sqlite_url, check=False).returncode == 1
    audit = _inproc_json("admin", "audit", db=sqlite_url)
    actions = [a["action"] for a in reversed(audit)]
    assert actions[-1] == "setting.policy"
    assert _inproc_json("admin", "locality", "set", "--quantum", "500", "--client-quantum", "3000",
                   db=sqlite_url) == {"quantum": 500.0, "client_quantum": 3000.0}
    shown = {r["setting"]: r for r in _inproc_json("admin", "locality", "show", db=sqlite_url)}
    assert (shown["locality.quantum"]["value"], shown["locality.quantum"]["source"]) == ("500.0", "database")
    assert shown["locality.window"] == {"setting": "locality.window", "value": 32, "source": "default"}
    bad = _inproc("admin", "locality", "set", "--client-quantum", "inf", db=sqlite_url, check=False)
    assert bad.returncode == 1 and "finite" in bad.stderr + bad.stdout
    assert _inproc_json("admin", "locality", "placement", db=sqlite_url)[0]["source"] == "default"
    _inproc("admin", "locality", "placement", "d2lpm", db=sqlite_url)
    assert _inproc_json("admin", "locality", "placement", db=sqlite_url)[0]["value"] == "d2lpm"
    assert _inproc_json("admin", "locality", "unset", "placement", "window", db=sqlite_url) == {
        "unset": ["placement"], "not_set": ["locality.window"]}
    assert _inproc_json("admin", "policy", "unset", db=sqlite_url)["unset"] == ["policy"]
    assert _inproc_json("admin", "policy", "show", db=sqlite_url)[0]["source"] == "default"
    assert _inproc("admin", "locality", "placement", "preble", db=sqlite_url, check=False).returncode == 1
    assert actions[:6] == ["app.create", "user.create", "key.create", "user.set_weight", "limit.set",
                           "app.disable"]
    weight_change = next(a for a in audit if a["action"] == "user.set_weight")
    assert json.loads(weight_change["before"])["weight"] == 1.0 and json.loads(weight_change["after"])["weight"] == 2.5
    dup = _inproc("admin", "app", "create", "chat", db=sqlite_url, check=False)
    assert dup.returncode == 1 and "already exists" in dup.stderr
    missing = _inproc("admin", "key", "create", "--app", "nope", db=sqlite_url, check=False)
    assert missing.returncode == 1 and "no app named 'nope'" in missing.stderr
    both = _inproc("admin", "weight", "set", "--user", "a", "--app", "b", "2", db=sqlite_url, check=False)
    assert both.returncode == 1


def test_keys_of_a_disabled_user_stop_working(sqlite_url):
    fg("admin", "app", "create", "chat", db=sqlite_url)
    fg_json("admin", "key", "create", "--app", "chat", "--user", "bob", db=sqlite_url)
    assert fg_json("admin", "user", "disable", "bob", db=sqlite_url)["disabled"] is True
    assert fg_json("admin", "user", "enable", "bob", db=sqlite_url)["disabled"] is False


async def test_usage_queries(tmp_path, sqlite_url):
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        alice = gw.client(await gw.key("chat", user="alice"))
        agent = gw.client(await gw.key("agents"))
        msgs = [{"role": "user", "content": "hi"}]
        for _ in range(2):
            await alice.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=3,
                                                extra_body={"ignore_eos": True})
        for stage in range(3):
            await agent.chat.completions.create(model="sim-llama", messages=msgs, max_tokens=5, user="bob",
                                                extra_body={"ignore_eos": True},
                                                extra_headers={"X-Fairgate-Interaction": "run-1"})
        with pytest.raises(Exception):
            await alice.chat.completions.create(model="nope", messages=msgs)
        await gw.rows()

        by_user = {r["user"]: r for r in await afg_json("usage", "summary", "--by", "user", db=sqlite_url)}
        assert set(by_user) == {"alice", "bob"}
        for key in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "throttled"):
            assert key in by_user["alice"]
        assert by_user["alice"]["requests"] == 3 and by_user["alice"]["completion_tokens"] == 6
        assert by_user["bob"]["completion_tokens"] == 15 and by_user["bob"]["throttled"] == 0
        by_app = {r["app"]: r for r in await afg_json("usage", "summary", "--by", "app", "--since", "1h", db=sqlite_url)}
        assert by_app["agents"]["requests"] == 3
        by_inter = await afg_json("usage", "summary", "--by", "interaction", "--app", "agents", db=sqlite_url)
        assert [(r["interaction"], r["requests"]) for r in by_inter] == [("run-1", 3)]
        assert await afg_json("usage", "summary", "--by", "user", "--since", "2000-01-01", "--until", "2000-01-02",
                              db=sqlite_url) == []
        top = await afg_json("usage", "top", "1", "--by", "user", db=sqlite_url)
        assert [r["user"] for r in top] == ["bob"]
        failures = await afg_json("usage", "failures", db=sqlite_url)
        assert [(f["user"], f["http_status"]) for f in failures] == [("alice", 404)]
        out = tmp_path / "usage.csv"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fairgate.cli.main", "usage", "export", "--format", "csv", "--out", str(out),
            "--database-url", sqlite_url)
        assert await proc.wait() == 0
        exported = list(csv.DictReader(out.open()))
        assert len(exported) == 6 and {"request_id", "prompt_tokens", "completion_tokens"} <= set(exported[0])


async def test_names_a_client_chose_are_shown_as_text_never_run(tmp_path, sqlite_url):
    """A user named as rich markup, a formula and a model or field name holding terminal escapes: the tables
    print them as text (no crash on a stray ``[/]``, no colour, no link, no escape reaching the terminal), the
    CSV export keeps a spreadsheet from evaluating them."""
    async with run_gateway(gateway_config(sqlite_url)) as gw:
        key = await gw.key("chat")
        msgs = [{"role": "user", "content": "hi"}]
        for user in ("[/]", "[link=https://evil.example]alice[/link]", '=HYPERLINK("https://evil.example")'):
            await gw.client(key).chat.completions.create(model="sim-llama", messages=msgs, max_tokens=2, user=user)
        with pytest.raises(Exception):  # (refused: its row's error names the field, escaped)
            await gw.client(key).chat.completions.create(model="sim-llama", messages=msgs,
                                                         extra_body={"x\x1b]52;c;QUJD\x07\x1b[2J[/]": 1})
        with pytest.raises(Exception):  # (refused: a model is printable)
            await gw.client(key).chat.completions.create(model="m\x1b[2J", messages=msgs)
        await gw.rows()
    shown = {command: (await asyncio.to_thread(_inproc, "usage", *command, db=sqlite_url)).stdout
             for command in (("summary", "--by", "user"), ("failures",), ("summary", "--by", "model"))}
    assert not any("\x1b" in out for out in shown.values()), shown
    assert "[/]" in shown["summary", "--by", "user"] and "[link=" in shown["summary", "--by", "user"]
    assert "\\u001b" in shown["failures",]  # (the field's name, its escapes written out)
    out = tmp_path / "usage.csv"
    await asyncio.to_thread(_inproc, "usage", "export", "--format", "csv", "--out", str(out), db=sqlite_url)
    users = {r["user"] for r in csv.DictReader(out.open())}
    assert '\'=HYPERLINK("https://evil.example")' in users and not any(u.startswith("=") for u in users)


def test_db_upgrade_and_serve_refuses_a_schema_behind(tmp_path):
    fresh = f"sqlite:///{tmp_path}/fresh.db"
    assert "revision 0012" in fg("db", "upgrade", db=fresh).stdout
    behind = tmp_path / "behind.db"
    with sqlite3.connect(behind) as c:  # an old deployment: tables, but not at this version's revision
        c.execute("CREATE TABLE apps (id INTEGER PRIMARY KEY)")
        c.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        c.execute("INSERT INTO alembic_version VALUES ('0000')")
    p = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "serve", "--port", "1",
                        "--database-url", f"sqlite:///{behind}"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "fairgate db upgrade" in p.stderr


def test_show_says_where_each_value_in_force_comes_from(sqlite_url, tmp_path, monkeypatch):
    """`admin fairserve show` prints every value in force with its source — default, file, environment,
    database — not only the database's overrides; `fairserve unset` hands a value back to the file."""
    config = tmp_path / "fairgate.yaml"
    config.write_text("policy: wsc\nfairserve:\n  alpha: 0.5\n")
    _inproc("admin", "fairserve", "set", "--alpha", "2", "--kv-threshold", "0.8", db=sqlite_url)
    monkeypatch.setenv("FAIRGATE_POLICY", "fairserve")
    rows = {r["setting"]: r for r in _inproc_json("admin", "fairserve", "show", "--config", str(config), db=sqlite_url)}
    assert rows["policy"] == {"setting": "policy", "value": "fairserve", "source": "environment FAIRGATE_POLICY"}
    assert rows["fairserve.alpha"] == {"setting": "fairserve.alpha", "value": "2.0", "source": "database",
                                       "configured": 0.5, "configured_source": f"file {config}"}
    assert rows["fairserve.gamma"]["source"] == "default"
    _inproc("admin", "fairserve", "unset", "alpha", db=sqlite_url)
    rows = {r["setting"]: r for r in _inproc_json("admin", "fairserve", "show", "--config", str(config), db=sqlite_url)}
    assert (rows["fairserve.alpha"]["value"], rows["fairserve.alpha"]["source"]) == (0.5, f"file {config}")
    assert rows["fairserve.kv_threshold"]["source"] == "database"
    table = _inproc("admin", "fairserve", "set", "--gamma", "3", db=sqlite_url).stdout
    assert "{" not in table and "gamma" in table
    bad = _inproc("admin", "fairserve", "set", "--alpha", "9", "--user", "nobody", "--e", "0.5", db=sqlite_url,
             check=False)
    assert bad.returncode == 1 and "no user named 'nobody'" in bad.stderr and "Traceback" not in bad.stderr
    alpha = next(r for r in _inproc_json("admin", "fairserve", "show", db=sqlite_url) if r["setting"] == "fairserve.alpha")
    assert alpha["source"] == "default"  # the refused command changed nothing


def test_the_default_database_is_the_same_from_any_directory(tmp_path):
    """Without --database-url, every command uses one SQLite file in the data directory ($FAIRGATE_HOME, else
    $XDG_DATA_HOME/fairgate, else ~/.local/share/fairgate), not one per working directory."""
    import os

    env = {**os.environ, "FAIRGATE_HOME": str(tmp_path / "home")}
    env.pop("FAIRGATE_DATABASE_URL", None)
    run = lambda cwd, *args: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "fairgate.cli.main", *args, "--json"], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=60, check=True).stdout
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    run(tmp_path / "a", "admin", "app", "create", "chat")
    assert [a["name"] for a in json.loads(run(tmp_path / "b", "admin", "app", "list"))] == ["chat"]
    assert (tmp_path / "home" / "fairgate.db").exists() and not list((tmp_path / "a").iterdir())


def test_serve_writes_a_json_access_log_without_keys_or_prompts(tmp_path):
    """`serve --log-format json`: every log line is a JSON object; each request with a key leaves one access
    record (ids, tenant, model, backend, outcome, tokens, queue wait, latency) that holds no key and no prompt."""
    import openai

    from tests.conftest import free_port

    db = f"sqlite:///{tmp_path}/fairgate.db"
    fg("admin", "app", "create", "chat", db=db)
    key = fg_json("admin", "key", "create", "--app", "chat", "--user", "ann", db=db)["key"]
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"port: {port}\nusage_journal: {tmp_path}/journal\nemulated: {{count: 1, speed: 50.0}}\n")
    log = open(tmp_path / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--config", str(config),
                             "--database-url", db, "--log-format", "json"], stdout=log, stderr=subprocess.STDOUT)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)
        for _ in range(100):
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                __import__("time").sleep(0.1)
        client.chat.completions.create(model="sim-llama", max_tokens=3,
                                       messages=[{"role": "user", "content": "the secret prompt"}])
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="sim-llama", messages=[], extra_headers={"x-request-id": "mine-1"})
        with pytest.raises(openai.NotFoundError):  # a client-named model of 100 KB: its record stays bounded
            client.chat.completions.create(model="m" * 100_000, messages=[{"role": "user", "content": "x"}])
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    text = (tmp_path / "gateway.log").read_text()
    records = [json.loads(line) for line in text.splitlines()]  # every line is JSON
    access = [r for r in records if r["logger"] == "fairgate.access"]
    assert [(a["status"], a["http_status"]) for a in access] == [("ok", 200), ("rejected", 400), ("rejected", 404)]
    ok, bad, unknown = access
    assert len(unknown["model"]) <= 257 and len(unknown["error"]) <= 257
    assert (ok["app"], ok["user"], ok["model"], ok["completion_tokens"]) == ("chat", "ann", "sim-llama", 3)
    assert ok["backend"] and ok["latency_ms"] >= ok["ttft_ms"] > 0 and "queue_wait_ms" in ok
    assert bad["client_request_id"] == "mine-1" and bad["level"] == "info"
    assert key not in text and key[:12] not in text and "secret prompt" not in text


def test_limits_budgets_and_prices_from_the_command_line(sqlite_url):
    """`admin limit|budget|price` set, show and clear, each audited; hostile values refused with a message;
    `usage spend` reports against the budget."""
    _inproc("admin", "app", "create", "chat", db=sqlite_url)
    key = _inproc_json("admin", "key", "create", "--app", "chat", "--user", "ann", db=sqlite_url)
    got = _inproc_json("admin", "limit", "set", "--app", "chat", "--tpm", "20000", "--rpm", "600", "--concurrency", "8",
                  db=sqlite_url)
    assert (got["target"], got["rpm"], got["tpm"], got["tpm_kind"], got["concurrency"]) == (
        "app:chat", 600, 20000, "total", 8)
    got = _inproc_json("admin", "limit", "set", "--app", "chat", "--user", "ann", "--tpm", "5000", "--tpm-kind", "output",
                  db=sqlite_url)
    assert (got["target"], got["tpm"], got["tpm_kind"]) == ("user:chat/ann", 5000, "output")
    assert _inproc_json("admin", "limit", "set", "--key", str(key["id"]), "--rpm", "60", db=sqlite_url)["rpm"] == 60
    got = _inproc_json("admin", "budget", "set", "--app", "chat", "--usd", "250", "--period", "month", db=sqlite_url)
    assert (got["budget_usd"], got["budget_period"], got["tpm"]) == (250.0, "month", 20000)  # limits kept
    price = _inproc_json("admin", "price", "set", "sim-llama", "--input", "0.15", "--output", "0.6", db=sqlite_url)
    assert (price["input"], price["output"], price["cached"]) == (0.15, 0.6, None)
    shown = {r["target"]: r for r in _inproc_json("admin", "limit", "show", db=sqlite_url)}
    assert set(shown) == {"app:chat", "user:chat/ann", f"key:{key['id']}"}
    for bad in (["--tpm", "-5"], ["--rpm", "many"], ["--tpm", "1" + "0" * 13], ["--tpm-kind", "tokens"]):
        p = _inproc("admin", "limit", "set", "--app", "chat", *bad, db=sqlite_url, check=False)
        assert p.returncode != 0 and "Traceback" not in p.stderr, (bad, p.stderr)
    for bad in (["--usd", "nan"], ["--tokens", "5", "--period", "year"]):
        p = _inproc("admin", "budget", "set", "--app", "chat", *bad, db=sqlite_url, check=False)
        assert p.returncode != 0 and "Traceback" not in p.stderr, (bad, p.stderr)
    p = _inproc("admin", "price", "set", "m", "--input", "-1", "--output", "1", db=sqlite_url, check=False)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert _inproc("admin", "limit", "set", "--key", "nope", "--rpm", "1", db=sqlite_url, check=False).returncode == 1
    cleared = _inproc_json("admin", "limit", "clear", "--app", "chat", db=sqlite_url)
    assert (cleared["rpm"], cleared["tpm"], cleared["concurrency"], cleared["budget_usd"]) == (None, None, None, 250.0)
    assert _inproc_json("admin", "budget", "clear", "--app", "chat", db=sqlite_url)["budget_usd"] is None
    actions = [a["action"] for a in _inproc_json("admin", "audit", db=sqlite_url)]
    assert actions.count("limit.set") == 4 and actions.count("budget.set") == 2 and "price.set" in actions
    spend = _inproc_json("usage", "spend", "--by", "app", db=sqlite_url)
    assert spend == []  # no request yet


def test_tables_fit_a_terminal_with_counts_and_money_written_for_people(monkeypatch):
    """An 80-column terminal: the columns that matter (``--wide`` for all), headers in words, thousands
    separators, dollars with the precision a small amount needs; ids as they are."""
    import io

    from rich.console import Console

    from fairgate.cli import common

    out = io.StringIO()
    monkeypatch.setattr(common, "console", Console(width=80, file=out))
    rows = [{"app": "chat", "user": f"user-{i}", "requests": 1234567, "prompt_tokens": 98765432,
             "cached_tokens": 5, "completion_tokens": 12345678, "total_tokens": 111111110, "ok": 1234000,
             "errors": 12, "cancelled": 3, "throttled": 552, "rejected": 0, "slo_requests": 0, "slo_met": 0}
            for i in range(3)]
    common.emit(rows, False, list(rows[0]), title="usage by user",
                narrow=["app", "user", "requests", "prompt_tokens", "completion_tokens", "errors", "throttled"])
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "prompt tok" in text and "1,234,567" in text and "98,765,432" in text and "--wide" in text
    assert "cached" not in text  # (a --wide column)
    out.truncate(0)
    common.emit([{"id": 12345, "app": "chat", "tokens": 1500, "usd": 0.0000108, "budget_usd": 250.0}], False)
    text = out.getvalue()
    assert "$0.000011" in text and "$250.00" in text and "12345" in text and "1,500" in text and "e-05" not in text
