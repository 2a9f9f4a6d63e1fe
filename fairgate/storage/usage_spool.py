"""The usage rows the database could not take, on disk until it can: JSON lines appended and fsync'd per
batch, replayed in their order when the database answers again (and at the next start, if the process died
or stopped while it was down). Bounded by ``max_bytes``: past that, rows wait in memory (and the log says so)."""

from __future__ import annotations

import logging
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import orjson

from fairgate.storage.models import UsageLog, UTCDateTime

log = logging.getLogger("fairgate.usage")
TIMES = frozenset(c.key for c in UsageLog.__table__.columns if isinstance(c.type, UTCDateTime))


def _load(line: bytes) -> dict[str, Any]:
    row = orjson.loads(line)
    for k in TIMES & row.keys():
        if isinstance(row[k], str):
            row[k] = datetime.fromisoformat(row[k])
    return row


class Spool:
    def __init__(self, path: str | Path, max_bytes: int = 1 << 30):
        self.path, self.max_bytes = Path(path), max_bytes
        self.rows = self._count()

    def _count(self) -> int:
        try:
            with open(self.path, "rb") as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def append(self, rows: list[dict[str, Any]]) -> bool:
        """Write ``rows`` after those already spooled, durably; False (nothing written) if it would not fit."""
        data = b"".join(orjson.dumps(r, default=str) + b"\n" for r in rows)
        size = self.path.stat().st_size if self.path.exists() else 0
        if size + len(data) > self.max_bytes:
            log.error("usage spool %s is full (%d bytes): %d rows wait in memory", self.path, size, len(rows))
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.rows += len(rows)
        return True

    def batches(self, size: int) -> Iterator[list[dict[str, Any]]]:
        batch: list[dict[str, Any]] = []
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    batch.append(_load(line))
                    if len(batch) == size:
                        yield batch
                        batch = []
        if batch:
            yield batch

    def keep_only(self, rows: list[dict[str, Any]]) -> None:
        """Replace the spool by ``rows`` (what a replay did not write), atomically."""
        if not rows:
            self.path.unlink(missing_ok=True)
            self.rows = 0
            return
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(orjson.dumps(r, default=str) + b"\n" for r in rows))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.rows = len(rows)
