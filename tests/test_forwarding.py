"""What a client's body may carry to the backend: the OpenAI and vLLM sampling fields pass; fields
that change the server's rendering, scheduling or KV movement, or make it fetch remote media, are refused
unless an admin allows them for the app; anything else is refused as OpenAI refuses it. The gateway always sets
vLLM's cache_salt, so one tenant cannot see another's prompts in the prefix cache."""

from __future__ import annotations

import pytest

from tests.conftest import gateway_config, run_gateway
from tests.test_trust_boundary import _post

DOC = "The quarterly report covers revenue, costs, hiring and the roadmap for the platform. " * 40
LONG = {"model": "sim-llama", "messages": [{"role": "system", "content": DOC}, {"role": "user", "content": "sum"}],
        "max_tokens": 2}
ONE_BACKEND = {"count": 1}


async def test_guarded_fields_need_an_admin_and_unknown_fields_are_refused(sqlite_url):
    async with run_gateway(gateway_config(sqlite_url, emulated=ONE_BACKEND, settings_refresh_s=0.1)) as gw:
        key = await gw.key("chat")
        hostile = [
            {"chat_template": "{{ 'pwned' }}"},
            {"kv_transfer_params": {"do_remote_prefill": True}},
            {"priority": -100},
            {"logits_processors": ["os.system"]},
            {"not_a_parameter": 1},
            {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}]}]},
        ]
        for extra in hostile:
            status, body, _ = await _post(gw, key, {**LONG, **extra})
            assert status == 400 and body["error"]["code"] == "unsupported_parameter", (extra, body)
        fine = {"temperature": 0.2, "top_k": 5, "ignore_eos": True, "seed": 1, "cache_salt": "mine"}
        assert (await _post(gw, key, {**LONG, **fine}))[0] == 200
        await gw.admin.allow_fields("chat", ["priority"])
        await gw.gateway.tenants.refresh()
        assert (await _post(gw, key, {**LONG, "priority": 3}))[0] == 200
        assert (await _post(gw, await gw.key("other"), {**LONG, "priority": 3}))[0] == 400  # per app
        rows = await gw.rows()
        assert len(rows) == len(hostile) + 3 and sum(r["status"] == "rejected" for r in rows) == len(hostile) + 1


@pytest.mark.parametrize("mode,cross_app_hits", [("app", False), ("shared", True)])
async def test_the_prefix_cache_is_shared_only_within_a_salt(sqlite_url, mode, cross_app_hits):
    """App A sends a long prompt twice: its second call hits the cache. App B sends the same prompt (with A's
    guess at a salt of its own): with salts per app (the default) it gets no hit; with `cache_salt: shared` it
    does, and so could learn that someone sent that prompt."""
    cfg = gateway_config(sqlite_url, emulated=ONE_BACKEND, cache_salt=mode)
    async with run_gateway(cfg) as gw:
        a, b = await gw.key("a"), await gw.key("b")
        cached = []
        for key, extra in ((a, {}), (a, {}), (b, {"cache_salt": "anything"})):
            status, body, _ = await _post(gw, key, {**LONG, **extra})
            assert status == 200, body
            cached.append(body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))
        assert cached[0] == 0 and cached[1] > 500
        assert (cached[2] > 500) is cross_app_hits, cached
