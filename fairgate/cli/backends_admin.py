"""`fairgate admin backends`: a running gateway's backends as it sees them — up or not, their models, and each
one's fitted latency model (the Aladdin forms it fits from their streams: docs/operations/metrics.md#latency-models),
read from its ``/ready`` with the operations token."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import typer

from fairgate.cli.common import JsonOption, emit, fail


def backends(url: str = typer.Option("http://127.0.0.1:8080", "--url", help="The gateway (or its operations "
                                     "port)."),
             token: str = typer.Option(None, "--token", help="Its operations token (default: $FAIRGATE_OPS_TOKEN; "
                                       "none where the gateway has none)."),
             json_: bool = JsonOption):
    """Each backend's state and latency fit, as one running gateway sees them."""
    token = token or os.environ.get("FAIRGATE_OPS_TOKEN")
    req = urllib.request.Request(url.rstrip("/") + "/ready",
                                 headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read(1 << 22))
    except urllib.error.HTTPError as e:
        if e.code != 503:  # (not ready still says why, and names its backends)
            fail(f"{url}/ready answered HTTP {e.code}")
        try:
            body = json.loads(e.read(1 << 22))
        except ValueError:
            fail(f"{url}/ready answered HTTP 503 without a JSON body")
    except (urllib.error.URLError, OSError, ValueError) as e:
        fail(f"cannot read {url}/ready: {e}")
    if not isinstance(body, dict) or "backends" not in body:
        fail("the gateway did not name its backends: give its operations token (--token or $FAIRGATE_OPS_TOKEN)")
    rows = []
    for name, b in sorted(body["backends"].items()):
        fit = b.get("latency") or {}
        row = {"backend": name, "up": b.get("up"), "models": b.get("models"), "error": b.get("error")}
        if fit:
            row.update({"prefill_ms_per_1k": round((fit["k1"] * 1000 + fit["c1"]) * 1000, 2),
                        "step_ms_b1_1k": round((fit["k2"] * 1000 + fit["c2"] + fit["c3"]) * 1000, 2),
                        "k1": fit["k1"], "c1": fit["c1"], "k2": fit["k2"], "c2": fit["c2"], "c3": fit["c3"],
                        "samples": f"{fit['prefill_samples']}/{fit['decode_samples']}"})
        rows.append(row)
    emit(rows if not json_ else {"ready": body.get("ready"), "reasons": body.get("reasons"), "backends": rows},
         json_, columns=None if json_ else ["backend", "up", "models", "prefill_ms_per_1k", "step_ms_b1_1k",
                                            "samples", "error"], title=None if json_ else "backends")
