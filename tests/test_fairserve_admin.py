"""FairServe's admin path: settings changed with `fairgate admin` reach a running gateway, `admin stats
rebuild` recomputes the statistics from the usage log and running gateways reload them, bad values are
refused with a message."""

from __future__ import annotations

import asyncio

import pytest

from fairgate.proxy.config import ConfigError, load_config
from tests.conftest import gateway_config, run_gateway
from tests.test_cli import fg, fg_json


def test_fairserve_config_section_is_validated():
    assert load_config(None, policy="fairserve", fairserve={"alpha": 2}).fairserve.alpha == 2
    with pytest.raises(ConfigError, match="unknown keys"):
        load_config(None, fairserve={"delta": 1})
    with pytest.raises(ConfigError, match="charge"):
        load_config(None, fairserve={"charge": "later"})


async def test_admin_changes_reach_a_running_gateway_and_a_rebuild_is_reloaded(sqlite_url):
    cfg = gateway_config(sqlite_url, policy="fairserve", settings_refresh_s=0.2, fairserve={"min_samples": 2})
    async with run_gateway(cfg) as gw:
        c = gw.client(await gw.key("writer", user="w"))
        for k in range(3):
            await c.chat.completions.create(model="sim-llama", max_tokens=5 + k, extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": "draft a line"}])
        await gw.rows()  # the usage rows are written
        loop = asyncio.get_running_loop()
        out = await loop.run_in_executor(None, lambda: fg_json(
            "admin", "fairserve", "set", "--alpha", "0.5", "--gamma", "3", "--user-rpm", "7", db=sqlite_url))
        assert out == {"alpha": 0.5, "gamma": 3.0, "user_rpm": 7}
        bad = await loop.run_in_executor(None, lambda: fg("admin", "fairserve", "set", "--charge", "never",
                                                          db=sqlite_url, check=False))
        assert bad.returncode == 1 and "admit or finish" in bad.stderr
        for _ in range(50):
            if gw.gateway.scheduler.tokens.alpha == 0.5:
                break
            await asyncio.sleep(0.05)
        s = gw.gateway.scheduler
        assert (s.tokens.alpha, s.tokens.beta, s.tokens.gamma) == (0.5, 2.0, 3.0)
        assert gw.gateway.fairserve.user_limit("user:writer/w") == 7
        # a rebuild from the usage log replaces what the gateway learned, and the gateway reloads it
        gw.gateway.fairserve.stats.entries.clear()
        rebuilt = await loop.run_in_executor(None, lambda: fg_json("admin", "stats", "rebuild", "--since", "1h",
                                                                   db=sqlite_url))
        assert rebuilt["calls"] == 3
        for _ in range(50):
            if ("writer", -1) in gw.gateway.fairserve.stats.entries:
                break
            await asyncio.sleep(0.05)
        assert gw.gateway.fairserve.stats.entries[("writer", -1)].n == 3
        shown = await loop.run_in_executor(None, lambda: fg_json("admin", "stats", db=sqlite_url))
        assert {r["app"] for r in shown["stats"]} >= {"writer"} and shown["suggested"]["user_rpm"] >= 1
        audit = await gw.admin.audit_log()
        assert {"setting.fairserve.alpha", "setting.stats.generation"} <= {a["action"] for a in audit}
