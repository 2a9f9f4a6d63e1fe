"""The long fuzz of the OpenAI surface: schemathesis draws requests from the official OpenAI spec cut to
what fairgate serves (tests/data/openai-openapi-subset.yaml) — valid ones and, in its negative mode, ones that
break the schema — and sends them to a real `fairgate serve` process (embedded defaults: two emulated backends,
SQLite) with a valid key. The suite's own fuzz (tests/test_fuzz.py) draws 2,000; this draws ``--cases`` (10,000 by
default, ~10 minutes here), with a fresh seed each run unless ``--seed`` is given.

    .venv/bin/python bench/fuzz_openai.py [--cases 10000] [--seed N]

Prints the statuses it got and exits non-zero on any 5xx other than 503 (a full queue), a traceback in the
gateway's log, or a request that should leave a usage row (every POST, and the reads and deletions of stored
responses) without exactly one.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, seed as hypothesis_seed
from schemathesis import GenerationMode

from netutil import free_port

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "tests" / "data" / "openai-openapi-subset.yaml"
PLAN = [  # (path, method, mode, share of the cases)
    ("/chat/completions", "POST", GenerationMode.POSITIVE, 0.25),
    ("/chat/completions", "POST", GenerationMode.NEGATIVE, 0.17),
    ("/completions", "POST", GenerationMode.POSITIVE, 0.18), ("/completions", "POST", GenerationMode.NEGATIVE, 0.12),
    ("/embeddings", "POST", GenerationMode.POSITIVE, 0.07), ("/embeddings", "POST", GenerationMode.NEGATIVE, 0.03),
    ("/responses", "POST", GenerationMode.POSITIVE, 0.07), ("/responses", "POST", GenerationMode.NEGATIVE, 0.03),
    ("/responses/{response_id}", "GET", GenerationMode.POSITIVE, 0.01),
    ("/responses/{response_id}", "DELETE", GenerationMode.POSITIVE, 0.01),
    ("/responses/{response_id}/input_items", "GET", GenerationMode.POSITIVE, 0.01),
    ("/responses/input_tokens", "POST", GenerationMode.POSITIVE, 0.01),
    ("/responses/{response_id}/cancel", "POST", GenerationMode.POSITIVE, 0.01),
    ("/models", "GET", GenerationMode.POSITIVE, 0.05), ("/models/{model}", "GET", GenerationMode.POSITIVE, 0.05)]


def fg(*args: str, db: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "fairgate.cli.main", *args, "--json", "--database-url", db],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def start(tmp: Path) -> tuple[subprocess.Popen, str, str, Path]:
    db = f"sqlite:///{tmp}/fairgate.db"
    fg("admin", "app", "create", "fuzz", db=db)
    key = fg("admin", "key", "create", "--app", "fuzz", db=db)["key"]
    port = free_port()
    (tmp / "fairgate.yaml").write_text(f"port: {port}\ndatabase_url: {db}\nusage_journal: {tmp}/journal\n"
                                       "queue_timeout_s: 30\nemulated: {count: 2, speed: 1000.0}\n")
    log = open(tmp / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fairgate.cli.main", "serve", "--config", str(tmp / "fairgate.yaml"),
                             "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/ready", timeout=1).status_code == 200:
                return proc, url, key, tmp / "gateway.log"
        except requests.ConnectionError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"the gateway did not start:\n{(tmp / 'gateway.log').read_text()}")


def fuzz(url: str, key: str, cases: int, seed: int) -> tuple[collections.Counter, list, int]:
    schema = schemathesis.openapi.from_path(str(SPEC))
    session = requests.Session()
    statuses: collections.Counter = collections.Counter()
    errors: list = []
    rowed = 0  # requests that leave a usage row: all but the model list's
    for path, method, mode, share in PLAN:
        count = 0

        @settings(max_examples=max(1, round(cases * share)), deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=schema[path][method].as_strategy(generation_mode=mode))
        def send(case):
            nonlocal count, rowed
            count += 1
            if isinstance(case.body, dict) and count % 3:
                case.body["model"] = "sim-llama"  # two in three go past the model check, into the queue
            case.headers = {**{k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"},
                            "Authorization": f"Bearer {key}"}
            try:
                r = case.call(base_url=url + "/v1", session=session, timeout=60)
            except (requests.exceptions.InvalidHeader, requests.exceptions.InvalidURL, UnicodeError, ValueError):
                return  # the client library refused to send it: nothing reached the gateway
            rowed += method == "POST" or path.startswith("/responses/")
            statuses[r.status_code] += 1
            if r.status_code >= 500 and r.status_code != 503:
                errors.append((case.path, case.body, r.status_code, r.text[:300]))

        started = time.monotonic()
        hypothesis_seed(seed)(send)()  # a run is reproducible with --seed
        print(f"{method} {path} ({mode.value}): {count} cases in {time.monotonic() - started:.0f} s", flush=True)
    return statuses, errors, rowed


def rows(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT count(*) FROM usage_log").fetchone()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, url, key, log = start(tmp)
        try:
            statuses, errors, rowed = fuzz(url, key, args.cases, seed)
            for _ in range(200):  # the rows are written behind the responses
                if rows(tmp / "fairgate.db") >= rowed:
                    break
                time.sleep(0.1)
            written = rows(tmp / "fairgate.db")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        tracebacks = log.read_text().count("Traceback")
    total = sum(statuses.values())
    fives = sum(n for s, n in statuses.items() if s >= 500 and s != 503)
    print(f"seed {seed}: {total} requests sent; statuses " + ", ".join(f"{s}: {n}" for s, n in sorted(statuses.items())))
    print(f"5xx (not 503): {fives}; tracebacks in the gateway's log: {tracebacks}; requests that leave a row "
          f"{rowed}, usage rows {written}")
    for e in errors[:5]:
        print("  ", e)
    ok = fives == 0 and tracebacks == 0 and written == rowed
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
