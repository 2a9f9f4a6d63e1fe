"""A tenant owns only its own names: an app key names users of its own app (the same name in another
app is another user, with its own weight, limit and counter); a user an admin shares among apps is one user
whichever app names it; `fairgate usage` groups users by app; fairness_key app>user runs live."""

from __future__ import annotations

import openai
import pytest

from fairgate.policies.two_level import TwoLevel, app_counter
from fairgate.storage import usage_queries
from tests.conftest import gateway_config, run_gateway

MSGS = [{"role": "user", "content": "hi"}]


async def _call(client: openai.AsyncOpenAI, user: str, tokens: int = 4) -> None:
    await client.chat.completions.create(model="sim-llama", messages=MSGS, max_tokens=tokens, user=user,
                                         extra_body={"ignore_eos": True})


async def test_an_app_key_names_users_of_its_own_app_only(sqlite_url):
    """Once user names were global: app "evil" naming "alice" spent chat's alice's counter, limit and
    weight (5). Now evil's alice is evil's own, and the weight 5 stays with chat's alice."""
    async with run_gateway(gateway_config(sqlite_url, policy="vtc")) as gw:
        for app in ("chat", "evil"):
            await gw.admin.create_app(app)
        await gw.admin.create_user("alice", app="chat", weight=5.0, rpm=2)
        await gw.admin.create_user("ops", weight=4.0)  # shared: every app's keys may name it
        await gw.gateway.tenants.refresh()
        chat = gw.client((await gw.admin.create_key("chat"))["key"])
        evil = gw.client((await gw.admin.create_key("evil"))["key"])
        await _call(evil, "alice")
        s, t = gw.gateway.scheduler, gw.gateway.tenants
        assert s.counter("user:chat/alice") == 0.0  # chat's alice was not charged for evil's call
        evil_charge = s.counter("user:evil/alice")
        assert evil_charge > 0 and t.weight("user:evil/alice") == 1.0 and t.rpm("user:evil/alice") == 60
        await _call(chat, "alice")  # joins the backlog lifted to the last to leave (evil's alice), pays 1/5
        assert s.counter("user:chat/alice") == pytest.approx(evil_charge + evil_charge / 5.0)
        assert t.own_limit("user:chat/alice") == 2
        await _call(evil, "ops")
        lifted = s.counter("user:ops") - evil_charge / 4.0
        await _call(chat, "ops")  # the same shared user whichever app names it: weight 4, one counter
        assert s.counter("user:ops") == pytest.approx(lifted + 2 * evil_charge / 4.0)
        rows = await gw.rows()
        assert [(r["app"], r["user"], r["fairness_key"]) for r in rows] == [
            ("evil", "alice", "user:evil/alice"), ("chat", "alice", "user:chat/alice"),
            ("evil", "ops", "user:ops"), ("chat", "ops", "user:ops")]
        by_user = await usage_queries.summary(gw.gateway.sessions, "user")
        assert sorted((r["app"], r["user"], r["requests"]) for r in by_user) == [
            ("chat", "alice", 1), ("chat", "ops", 1), ("evil", "alice", 1), ("evil", "ops", 1)]


async def test_a_user_key_of_one_app_stays_that_apps_user(sqlite_url):
    """Keys bound to "bob" in two apps are two users; a key's user can be disabled per app."""
    async with run_gateway(gateway_config(sqlite_url, policy="vtc")) as gw:
        a, b = await gw.key("a", user="bob"), await gw.key("b", user="bob")
        assert {(u["app"], u["name"]) for u in await gw.admin.list("users")} == {("a", "bob"), ("b", "bob")}
        await gw.admin.set_disabled("user", "bob", True, app="a")
        gw.gateway.keys._cache.clear()
        with pytest.raises(openai.AuthenticationError):
            await _call(gw.client(a), "bob")
        await _call(gw.client(b), "bob")
        assert [r["fairness_key"] for r in await gw.rows()] == ["user:b/bob"]


async def test_two_level_fairness_runs_live(sqlite_url):
    """fairness_key app>user: the gateway's policy is VTC over apps, then users; every charge reaches both."""
    async with run_gateway(gateway_config(sqlite_url, policy="vtc", fairness_key="app>user")) as gw:
        s = gw.gateway.scheduler
        assert isinstance(s, TwoLevel)
        await gw.admin.create_app("heavy", weight=2.0)
        await gw.gateway.tenants.refresh()
        client = gw.client(await gw.key("heavy"))
        for user in ("u1", "u2"):
            await _call(client, user)
        charge = s.counter("user:heavy/u1")  # u1's one call (u2's counter also holds its lift to u1's)
        assert charge > 0 and s.counter("user:heavy/u2") == pytest.approx(2 * charge)
        assert s.counter(app_counter("heavy")) == pytest.approx(2 * charge / 2.0)  # both calls, by the app's weight
