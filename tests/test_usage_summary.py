"""`fairgate usage summary|failures` answer an operator's questions whole: outcomes that add up to the
requests, per day or hour (UTC), relative times, full ids, newest first — on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone

from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
from fairgate.storage.models import UsageLog



def days() -> tuple[datetime, datetime]:
    """Today's and yesterday's UTC midnights, as the CLI will read `today` and `yesterday` during the test:
    within 30 s of a midnight, wait it out (the test takes a few seconds)."""
    now = datetime.now(timezone.utc)
    midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
    left = (midnight + timedelta(days=1) - now).total_seconds()
    if left < 30:
        time.sleep(left + 1)
        return days()
    return midnight, midnight - timedelta(days=1)


def fg(*args: str, db: str, columns: int = 250) -> str:
    p = subprocess.run([sys.executable, "-m", "fairgate.cli.main", "usage", *args, "--database-url", db],
                       capture_output=True, text=True, timeout=60, env={"COLUMNS": str(columns), "PATH": ""})
    assert p.returncode == 0, p.stderr
    return p.stdout


def row(i: int, at: datetime, user: str | None, status: str = "ok", model: str | None = "m", **kw) -> UsageLog:
    return UsageLog(request_id=f"req-{i:04d}-{'x' * 40}", app="chat", user=user, interaction=f"i{i}",
                    endpoint="chat", model=model, backend="gpu-0" if status == "ok" else None, arrival=at,
                    status=status, http_status={"ok": 200, "rejected": 400, "throttled": 429,
                                                "error": 502, "cancelled": 499}[status],
                    prompt_tokens=kw.get("prompt", 10), completion_tokens=kw.get("completion", 5))


async def seed(url: str, MIDNIGHT: datetime, YESTERDAY: datetime) -> None:  # noqa: N803
    engine = make_engine(url)
    await ensure_schema(engine)
    rows = [row(1, YESTERDAY + timedelta(hours=1), "ann"), row(2, YESTERDAY + timedelta(hours=1, minutes=5), "ann"),
            row(3, YESTERDAY + timedelta(hours=23), "bob", completion=100),
            row(4, YESTERDAY + timedelta(hours=2), "ann", "rejected", model=None, prompt=0, completion=0),
            row(5, YESTERDAY + timedelta(hours=3), "bob", "throttled", prompt=0, completion=0),
            row(6, MIDNIGHT + timedelta(minutes=1), "ann", "error", completion=0),
            row(7, YESTERDAY - timedelta(hours=1), "ann")]  # the day before: outside "yesterday"
    async with sessionmaker(engine).begin() as s:
        s.add_all(rows)
    await engine.dispose()


def test_usage_per_day_and_hour_add_up(db_url):
    MIDNIGHT, YESTERDAY = days()  # noqa: N806
    asyncio.run(seed(db_url, MIDNIGHT, YESTERDAY))
    day = YESTERDAY.date().isoformat()
    # who used how many tokens yesterday, per day (the README's one command)
    doc = json.loads(fg("summary", "--by", "user", "--by", "day", "--since", "yesterday", "--until", "today",
                        "--json", db=db_url))
    assert [(r["day"], r["user"], r["total_tokens"], r["requests"]) for r in doc] == [
        (day, "bob", 110, 2), (day, "ann", 30, 3)]
    for r in doc:
        assert r["ok"] + r["errors"] + r["cancelled"] + r["throttled"] + r["rejected"] == r["requests"]
    assert (doc[1]["rejected"], doc[0]["throttled"]) == (1, 1)
    hours = json.loads(fg("summary", "--by", "hour", "--since", "3d", "--json", db=db_url))
    assert [h["hour"] for h in hours] == sorted({h["hour"] for h in hours}, reverse=True)  # newest first
    assert hours[0]["hour"] == MIDNIGHT.strftime("%Y-%m-%dT%H:00") and hours[0]["errors"] == 1
    assert sum(h["requests"] for h in hours) == 7
    table = fg("summary", "--by", "model", db=db_url)
    assert "(no model)" in table and "throttled" in table and "rejected" not in table  # (a --wide column)
    assert "rejected" in fg("summary", "--by", "model", "--wide", db=db_url)


def test_failures_are_newest_first_with_whole_ids(db_url):
    asyncio.run(seed(db_url, *days()))
    doc = json.loads(fg("failures", "--since", "3d", "--json", db=db_url))
    assert [f["status"] for f in doc] == ["error", "throttled", "rejected"]
    table = fg("failures", "--since", "3d", db=db_url, columns=100)  # a narrow terminal folds, never cuts
    assert "…" not in table and "x" * 20 in table.replace("\n", "").replace("│", "").replace(" ", "")
