"""Configuration loading, and migrations that match the models."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from fairgate.proxy.config import ConfigError, load_config
from fairgate.storage.db import ensure_schema, make_engine
from fairgate.storage.models import Base


def test_yaml_env_and_flags(tmp_path, monkeypatch):
    cfg = tmp_path / "fairgate.yaml"
    cfg.write_text("port: 9000\nbackends:\n  - url: http://gpu-1:8000\n    kv_tokens: 50000\n  - http://gpu-2:8000\n"
                   "tokenizers: {llama: cl100k_base}\n")
    monkeypatch.setenv("FAIRGATE_CONFIG", str(cfg))
    monkeypatch.setenv("FAIRGATE_DATABASE_URL", "postgresql://db/fg")
    c = load_config(None, port=9100)
    assert c.port == 9100 and c.database_url == "postgresql://db/fg"
    assert [b.url for b in c.backends] == ["http://gpu-1:8000", "http://gpu-2:8000"]
    assert c.backends[0].kv_tokens == 50000 and c.tokenizers == {"llama": "cl100k_base"}


def test_bad_config_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prot: 9000\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="unknown policy"):
        load_config(None, policy="lottery")
    assert load_config(None, placement="power-of-two").placement == "power-of-two"
    assert load_config(None, policy="vtc").policy == "vtc"
    with pytest.raises(ConfigError, match="backend url"):
        load_config(None, backends=["localhost:8000"])  # no scheme: a typo caught at start, not per request


def test_a_key_of_an_earlier_version_is_read_as_what_it_became(tmp_path, caplog):
    """``usage_spool`` named where rows waited out an outage, beside the journal at ``<usage_spool>.journal``;
    the journal is that place now: an old file finds the journal its gateway left."""
    old = tmp_path / "old.yaml"
    old.write_text("usage_spool: /var/lib/fairgate/spool.jsonl\nusage_spool_max_bytes: 1000\n")
    c = load_config(str(old))
    assert c.usage_journal == "/var/lib/fairgate/spool.jsonl.journal"
    assert c.source("usage_journal") == f"file {old}"
    assert caplog.text.count("obsolete") == 2


async def test_migrations_match_models(db_url):
    engine = make_engine(db_url)
    try:
        assert await ensure_schema(engine) == "0012"
        async with engine.connect() as conn:
            diff = await conn.run_sync(lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata))
        assert diff == []
    finally:
        await engine.dispose()


async def test_users_of_a_deployment_before_0005_become_shared_users_and_their_keys_keep_working(db_url):
    """0005 gives users an app. A database written at 0004 (users global) upgrades in place: each existing user
    becomes a shared user (what it was), its key still resolves, and new users of an app may reuse its name."""
    from alembic import command
    from sqlalchemy import text

    from fairgate.storage.db import alembic_config, sessionmaker, upgrade
    from fairgate.storage.identity import Admin, hash_key, lookup_key

    engine = make_engine(db_url)
    try:
        def to_0004(conn):
            cfg = alembic_config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "0004")

        async with engine.begin() as conn:
            await conn.run_sync(to_0004)
            await conn.execute(text("INSERT INTO apps (name, weight, disabled, created_at) "
                                    "VALUES ('chat', 1.0, false, CURRENT_TIMESTAMP)"))
            await conn.execute(text("INSERT INTO users (name, weight, disabled, created_at) "
                                    "VALUES ('alice', 2.0, false, CURRENT_TIMESTAMP)"))
            await conn.execute(text("INSERT INTO api_keys (key_hash, prefix, app_id, user_id, disabled, created_at) "
                                    "SELECT :h, 'fg-old', apps.id, users.id, false, CURRENT_TIMESTAMP "
                                    "FROM apps, users"), {"h": hash_key("fg-old-key")})
        assert await upgrade(engine) == "0012"
        sessions = sessionmaker(engine)
        async with sessions() as s:
            ident = await lookup_key(s, "fg-old-key")
        assert (ident.user, ident.user_weight, ident.user_shared) == ("alice", 2.0, True)
        admin = Admin(sessions)
        await admin.create_user("alice", app="chat")  # the app's own alice, beside the shared one
        users = {(u["app"], u["name"]) for u in await admin.list("users")}
        assert users == {(None, "alice"), ("chat", "alice")}
    finally:
        await engine.dispose()


def test_redis_urls_one_server_or_a_cluster():
    from fairgate.storage.redis_client import parse_cluster_url

    for url in ("redis://127.0.0.1:6379/0", "rediss://h:6380", "unix:///run/redis.sock",
                "redis+cluster://a:7000,b:7001", "rediss+cluster://u:p@[::1]:7000,h/0"):
        assert load_config(None, redis_url=url).redis_url == url
    c = parse_cluster_url("rediss+cluster://u:p%40ss@[::1]:7000,h/0")
    assert c.nodes == (("::1", 7000), ("h", 6379)) and (c.username, c.password, c.ssl) == ("u", "p@ss", True)
    for url, why in (("http://r:6379", "unknown scheme 'http'.*redis\\+cluster://"),
                     ("redis+cluster://a:7000,b:x", "host:port"),
                     ("redis+cluster://a:7000/2", "one database"),
                     ("redis+cluster://:pw@a:7000?x=1", "options")):
        with pytest.raises(ConfigError, match=why) as e:
            load_config(None, redis_url=url)
        assert "pw" not in str(e.value)  # the password is never echoed
