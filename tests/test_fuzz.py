"""The OpenAI surface fuzzed from its own spec: schemathesis draws requests from the official OpenAI
OpenAPI document cut to what fairgate serves (tests/data/openai-openapi-subset.yaml) — valid ones and, in its
negative mode, ones that break the schema — and sends them to a real `fairgate serve` process with a valid key.
However hostile the body: never a 500, never a traceback in the gateway's log, and every request with a key (but the
model list) leaves exactly one usage row."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.core.errors import UnsupportedSchema

from tests.conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # 2,000 draws: ~2 min here, more on a loaded machine
SPEC = Path(__file__).with_name("data") / "openai-openapi-subset.yaml"
SCHEMA = schemathesis.openapi.from_path(str(SPEC))
# (path, method, mode, examples): 2,000 requests in all
PLAN = [("/chat/completions", "POST", GenerationMode.POSITIVE, 250),
        ("/chat/completions", "POST", GenerationMode.NEGATIVE, 150),
        ("/completions", "POST", GenerationMode.POSITIVE, 150),
        ("/completions", "POST", GenerationMode.NEGATIVE, 100),
        ("/embeddings", "POST", GenerationMode.POSITIVE, 150),
        ("/embeddings", "POST", GenerationMode.NEGATIVE, 100),
        ("/responses", "POST", GenerationMode.POSITIVE, 150),
        ("/responses", "POST", GenerationMode.NEGATIVE, 100),
        ("/responses/{response_id}", "GET", GenerationMode.POSITIVE, 30),
        ("/responses/{response_id}", "DELETE", GenerationMode.POSITIVE, 20),
        ("/responses/{response_id}/input_items", "GET", GenerationMode.POSITIVE, 30),
        ("/responses/input_tokens", "POST", GenerationMode.POSITIVE, 40),
        ("/responses/{response_id}/cancel", "POST", GenerationMode.POSITIVE, 20),
        ("/models", "GET", GenerationMode.POSITIVE, 50),
        ("/models/{model}", "GET", GenerationMode.POSITIVE, 50)]


def _fg(*args: str, db: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args, "--json", "--database-url", db],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    db = f"sqlite:///{tmp}/fairgate.db"
    _fg("admin", "app", "create", "fuzz", db=db)
    key = _fg("admin", "key", "create", "--app", "fuzz", db=db)["key"]
    port = free_port()
    (tmp / "fairgate.yaml").write_text(
        f"port: {port}\ndatabase_url: {db}\nusage_journal: {tmp}/journal\nqueue_timeout_s: 30\n"
        "emulated: {count: 2, speed: 1000.0}\n")
    log = open(tmp / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--config", str(tmp / "fairgate.yaml"),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if requests.get(url + "/ready", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert proc.poll() is None, (tmp / "gateway.log").read_text()
        time.sleep(0.1)
    yield url, key, tmp / "fairgate.db", tmp / "gateway.log"
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    log.close()


def _usage_rows(path: Path) -> int:
    with sqlite3.connect(path) as c:
        return c.execute("SELECT count(*) FROM usage_log").fetchone()[0]


def test_generated_requests_no_500_no_traceback_one_row_each(gateway):
    url, key, db, log = gateway
    session = requests.Session()
    served, server_errors, rowed, planned, cut = [], [], [0], 0, []
    for path, method, mode, examples in PLAN:
        strategy = SCHEMA[path][method].as_strategy(generation_mode=mode)
        count = [0]

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def send(case):
            count[0] += 1
            if isinstance(case.body, dict) and count[0] % 3:
                case.body["model"] = "sim-llama"  # two in three go past the model check, into the queue
            headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
            headers["Authorization"] = f"Bearer {key}"
            case.headers = headers
            try:
                r = case.call(base_url=url + "/v1", session=session, timeout=60)
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError):
                return  # the client library refused to send it: nothing reached the gateway
            rowed[0] += method == "POST" or path.startswith("/responses/")  # (every request with a key but
            # the model list leaves one row)
            served.append(r.status_code)
            if r.status_code >= 500 and r.status_code != 503:
                server_errors.append((case.path, case.body, r.status_code, r.text[:300]))

        try:
            send()
            planned += examples
        except UnsupportedSchema as e:  # the generator's limit, not the gateway's: it met, drawing a negative case
            # below the document root, a `not` whose complement it cannot spell (seen once in a full suite's run)
            cut.append((path, method, mode.value, count[0], str(e)[:120]))
            planned += count[0] - 1
    print("cut short by the generator:", cut)
    assert len(cut) <= 1, cut
    assert len(served) >= 0.95 * planned, (len(served), planned)
    assert server_errors == [], server_errors[:5]
    for _ in range(100):  # the rows are written behind the responses
        if _usage_rows(db) >= rowed[0]:
            break
        time.sleep(0.1)
    assert _usage_rows(db) == rowed[0]
    assert "Traceback" not in log.read_text()
    assert sum(s == 200 for s in served) > 150 and sum(400 <= s < 500 for s in served) > 150


HOSTILE = [  # (raw body, content type, expected status)
    (b"\xff\xfe not utf-8", "application/json", 400),
    (b"[" * 100_000 + b"]" * 100_000, "application/json", 400),  # nesting deeper than any parser allows
    (b'{"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
     "application/json", 400),
    (b'{"model": "sim-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}',
     "application/json", 400),
    (b'{"model": "sim-llama", "messages": [], "max_tokens": 1}', "application/json", 400),
    (b'{"model": "sim-llama", "messages": [{"role": "user", "content": [{"type": 5}]}]}', "application/json", 400),
    (b'{"model": "sim-llama", "messages": ' + b'[{"role": "user", "content": "x"}' + b', {"role": "user", '
     b'"content": "x"}' * 500 + b'], "max_tokens": 1}', "application/json", 200),
    (b'{"model": null, "messages": null}', "text/plain", 400),
    (b"null", "application/json", 400),
    (b'{"model": "sim-llama", "prompt": "hi", "max_tokens": 2}', "application/x-www-form-urlencoded", 400),
]


@pytest.mark.parametrize("raw,ctype,expected", HOSTILE, ids=range(len(HOSTILE)))
def test_hand_written_hostile_bodies(gateway, raw, ctype, expected):
    url, key, _, log = gateway
    r = requests.post(url + "/v1/chat/completions", data=raw, timeout=60,
                      headers={"Authorization": f"Bearer {key}", "Content-Type": ctype})
    assert r.status_code == expected, r.text[:300]
    assert r.json()["error"] if r.status_code >= 400 else r.json()["choices"]
    assert "Traceback" not in log.read_text()
