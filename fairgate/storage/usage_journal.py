"""The usage journal: every row, on disk as its request ends, until the database holds it — so a gateway killed
(``kill -9``, an OOM kill, a node eviction) loses no row of an answer its client received, and an outage of the
database none either: the journal is where rows wait it out.

A row is appended to the current segment (``<path>.<n>``, JSON lines) with one ``write`` as the request ends,
before its client's last bytes are written: the operating system has it then, so a killed process loses
nothing; ``fsync`` follows every ``fsync_s`` (so a lost machine loses at most that), or with every row when
``fsync_s`` is 0. The usage writer starts a new segment as it takes a batch (``rotate``) and deletes the
segments before it once the batch is in the database (``clear_before``); while the database is away the
segments stay, and are written, oldest first, when it answers again — or at the next start, which finds the
segments a previous run left. The database's unique ``request_id`` makes every replay exactly once. A lock
(``<path>.lock``) keeps two gateways from sharing a journal: the second refuses to start. Holds what the usage
row holds: no prompt, no completion, no key. Bounded by the writer: a segment lives until its rows are
written; a full disk fails the writes loudly (``error``, and /ready) and the rows wait in memory instead. Pure
I/O on local files."""

from __future__ import annotations

import fcntl
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


def _numbered(base: Path) -> list[tuple[int, Path]]:
    """The files ``<base>.<n>`` (a journal's segments), oldest first."""
    out = []
    for p in base.parent.glob(base.name + ".*"):
        suffix = p.name[len(base.name) + 1:]
        if suffix.isdigit():
            out.append((int(suffix), p))
    return sorted(out)


def adopt(path: str | Path, legacy: list[Path]) -> int:
    """Rows an earlier version left where it kept them — its spool (one file of JSON lines) or its journal's
    segments (``<base>.<n>``) — moved in as segments of the journal at ``path``, numbered after its own (a
    replay writes each row once whatever the order). Returns the files moved. ``Journal`` calls it with its
    lock held."""
    path = Path(path)
    own = _numbered(path)
    seq, moved = (own[-1][0] + 1 if own else 0), 0
    for old in legacy:
        if old == path:  # (the journal itself, where an earlier version kept it too)
            continue
        for f in [old] if old.is_file() else [p for _, p in _numbered(old)]:
            if f.stat().st_size:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.replace(f, f"{path}.{seq}")
                seq, moved = seq + 1, moved + 1
            else:
                f.unlink()
    if moved:
        log.warning("usage journal %s: %d files of rows an earlier version kept (%s) moved in, to be written "
                    "first", path, moved, ", ".join(str(p) for p in legacy))
    return moved


class JournalBusy(RuntimeError):
    """Another process holds the journal."""


class Journal:
    def __init__(self, path: str | Path, fsync_s: float = 1.0, legacy: list[Path] = ()):
        """``legacy``: where an earlier version kept rows (``adopt``), moved in once the lock is held."""
        self.path, self.fsync_s = Path(path), fsync_s
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise JournalBusy(f"the usage journal {self.path} is another gateway's (its lock is held): give each "
                              "gateway its own `usage_journal`") from None
        if legacy:
            adopt(self.path, list(legacy))
        self.leftover = self.segments()  # a previous run's, to be written first
        self._seq = (self.leftover[-1][0] + 1) if self.leftover else 0
        self._fd: int | None = self._open(self._seq)
        self._rotated: list[int] = []  # segments rotated since the last sync, open until it has synced them
        self.dirty = False
        self.rows = 0  # appended by this process
        self.error: str | None = None  # why the last write failed (a full disk): /ready says so until one works

    def segments(self) -> list[tuple[int, Path]]:
        """The journal's segments, oldest first."""
        return _numbered(self.path)

    def _open(self, seq: int) -> int:
        return os.open(f"{self.path}.{seq}", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    @property
    def current(self) -> int:
        """The number of the segment rows are appended to now."""
        return self._seq

    def append(self, line: bytes) -> bool:
        """One row (a JSON line), written through to the operating system; False if it could not be. Never
        raises: a failed write (a full disk) is logged once and kept in ``error`` for /ready; the row still goes
        to the database. After ``close`` (a row that came late), the current segment is opened again and the
        row synced at once: the next start writes it."""
        late = self._fd is None
        try:
            if late:
                self._fd = self._open(self._seq)
            if os.write(self._fd, line) != len(line):
                raise OSError("a short write")
            if self.fsync_s <= 0 or late:
                os.fsync(self._fd)
            else:
                self.dirty = True
        except OSError as e:
            self.failed(e)
            return False
        finally:
            if late and self._fd is not None:
                os.close(self._fd)
                self._fd = None
        self.rows += 1
        self.error = None
        return True

    def failed(self, e: OSError) -> None:
        """A write, sync or rotation failed: logged once, and kept for /ready until a row is written again."""
        if self.error is None:
            log.error("usage journal %s: a row could not be written (%s): rows are not safe from a crash until "
                      "it can", self.path, e)
        self.error = f"{self.path}: {e}"

    def sync(self) -> None:
        """The rows written since the last sync, onto the disk (the group commit): the current segment's, and
        those of the segments rotated since (their rows may wait out an outage here). Runs in a thread beside
        the event loop's appends and rotations: a file it syncs is closed by it alone (``rotate`` hands the old
        one over), and a row appended as it starts is synced now or marks the journal for the next sync."""
        rotated, self._rotated = self._rotated, []
        dirty, self.dirty = self.dirty, False
        fd = self._fd
        current = [fd] if dirty and fd is not None else []
        for fd in rotated + current:
            try:
                os.fsync(fd)
            except OSError as e:
                self.failed(e)
        for fd in rotated:
            try:
                os.close(fd)
            except OSError as e:
                self.failed(e)

    def rotate(self) -> int | None:
        """Start a new segment; the rows written so far are in the segments before the number returned (None:
        no segment could be started — a full disk, no file descriptor —, the rows stay in the current one). The
        old file is synced and closed by the next ``sync``, off the event loop."""
        try:
            fd = self._open(self._seq + 1)
        except OSError as e:
            self.failed(e)
            return None
        if self.fsync_s > 0:
            self._rotated.append(self._fd)  # (even if clean: a sync under way may hold it)
        else:
            os.close(self._fd)
        self.dirty = False  # (the old file's rows go with it)
        self._seq += 1
        self._fd = fd
        return self._seq

    def clear_before(self, seq: int) -> None:
        """The segments before ``seq`` are in the database: deleted."""
        for n, p in self.segments():
            if n < seq:
                p.unlink(missing_ok=True)

    @staticmethod
    def read(path: Path) -> Iterator[dict[str, Any]]:
        """A segment's rows; a last line cut short (the process died mid-write) is skipped."""
        with open(path, "rb") as f:
            for line in f:
                if line.endswith(b"\n") and line.strip():
                    try:
                        yield _load(line)
                    except ValueError:
                        log.error("usage journal %s: a damaged line skipped", path)

    @staticmethod
    def count(path: Path) -> int:
        """The rows of a segment (its complete lines)."""
        with open(path, "rb") as f:
            return sum(1 for line in f if line.endswith(b"\n") and line.strip())

    def close(self) -> None:
        if self._fd is None:
            return
        self.sync()
        os.close(self._fd)
        self._fd = None
        current = Path(f"{self.path}.{self._seq}")
        if current.exists() and current.stat().st_size == 0:  # (no empty segment left behind)
            current.unlink()
        if not self.segments():  # nothing to keep: no lock file left behind either (removed while held)
            Path(f"{self.path}.lock").unlink(missing_ok=True)
        os.close(self._lock)
