"""The gateway's logs: one line per record, as text or JSON lines (``serve --log-format``), and the access
log — one record per request that carried a valid key, at info as the ``fairgate.access`` logger (written by
``AccessLog``, from the request's usage row): ids, tenant, model, backend, outcome, tokens, queue wait and
latency; never a key, a prompt or a completion.
Requests refused before a key was checked (401) are counted in ``fairgate_auth_failures_total`` instead,
so a keyless flood cannot fill the disk.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import operator
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

import orjson

from fairgate.printable import printable

ACCESS = logging.getLogger("fairgate.access")
FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELD_CHARS = 256  # the usage log's widest id column


class AccessLog:
    """The access log's writer. A record is built from the request's usage row (before the row is fitted to SQL)
    and appended to a buffer that is written, with one system call, once the event loop's current turn is
    over: the requests that end in one turn share a write, and none waits for it. It writes to the stream the
    other records go to, in their format, without the logging module's per-record machinery (a ``LogRecord``,
    handler locks, a formatter): a busy gateway writes one record per request."""

    def __init__(self) -> None:
        self.on = False  # until ``configure`` (as the logging module, which shows no info record before it)
        self.json = False
        self.stream: TextIO = sys.stderr
        self._lines: list[str] = []
        self._second = -1
        self._stamp = ""

    def record(self, row: dict[str, Any], interaction: str | None, first_token_at: datetime | None) -> None:
        """One request's record, from its usage ``row``; ``interaction`` is None for a call that named none."""
        if not self.on:
            return
        arrival, finished, wait = row["arrival"], row["finished_at"], row["queue_wait_ms"]
        values = (row["request_id"], row["client_request_id"], row["app"], row["user"], interaction,
                  row["endpoint"], row["model"], row["stream"], row["backend"], row["status"], row["http_status"],
                  row["throttle_reason"], row["prompt_tokens"] if row["dispatched_at"] else 0, row["cached_tokens"],
                  row["completion_tokens"], None if wait is None else round(wait, 1),
                  None if first_token_at is None else round((first_token_at - arrival) / _MS, 1),
                  None if finished is None else round((finished - arrival) / _MS, 1), row["attempts"], row["error"])
        now = time.time()
        if self.json:
            doc: dict[str, Any] = {"time": self._time(now, True), "level": "info", "logger": ACCESS.name,
                                   "message": "request"}
            doc.update((k, _clip(v) if type(v) is str else v) for k, v in zip(FIELDS, values) if v is not None)
            line = orjson.dumps(doc, default=str).decode()
        else:
            line = f"{self._time(now, False)} INFO {ACCESS.name}: request " + _text_fields(values)
        if not self._lines:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no loop: at once
                self._lines.append(line)
                self.flush()
                return
        self._lines.append(line)

    def flush(self) -> None:
        lines, self._lines = self._lines, []
        if lines:
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: as the logging module, carry on
                pass

    def _time(self, now: float, iso: bool) -> str:
        """As the other records: ISO 8601 in UTC (JSON), or the logging module's local asctime (text)."""
        second = int(now)
        if second != self._second:
            self._second = second
            self._stamp = (datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") if iso else
                           time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second)))
        ms = _THOUSANDTHS[int((now - second) * 1000)]
        return f"{self._stamp}.{ms}+00:00" if iso else f"{self._stamp},{ms}"


ACCESS_LOG = AccessLog()
atexit.register(ACCESS_LOG.flush)


FIELDS = ("request_id", "client_request_id", "app", "user", "interaction", "endpoint", "model", "stream", "backend",
          "status", "http_status", "reason", "prompt_tokens", "cached_tokens", "completion_tokens", "queue_wait_ms",
          "ttft_ms", "latency_ms", "attempts", "error")  # an access record's, in order
NAMES = ("request_id", "client_request_id", "app", "user", "interaction", "endpoint", "model", "backend", "status",
         "reason", "error")  # the fields that are names (str or None); the others are numbers or flags
_NAMES_OF = operator.itemgetter(*(FIELDS.index(k) for k in NAMES))
_PROBE = "%s" * len(NAMES)
_MS = timedelta(milliseconds=1)
_THOUSANDTHS = [f"{n:03d}" for n in range(1000)]  # a record's milliseconds, written (``:03d`` formats slowly)


def _text_fields(values: tuple) -> str:
    """``k=v`` for each of FIELDS whose value is not None; a name clipped to FIELD_CHARS and JSON-quoted if it
    is empty, or holds a space, a quote, an ``=`` or what is not printable (``_text``). Most records need
    neither: that is checked on all their names at once (a None reads "None", harmless to every check), in C;
    a record's other values are numbers and flags (tests/test_access_log.py)."""
    names = _NAMES_OF(values)
    probe = _PROBE % names
    if (len(probe) <= FIELD_CHARS and probe.isprintable() and " " not in probe and '"' not in probe
            and "=" not in probe and "" not in names):
        return " ".join([f"{k}={v}" for k, v in zip(FIELDS, values) if v is not None])
    return " ".join([f"{k}={_text(_clip(v)) if type(v) is str else v}" for k, v in zip(FIELDS, values)
                     if v is not None])


def _clip(value: str) -> str:
    """A client-named string (its model, say) at most FIELD_CHARS long: a record stays one bounded line."""
    return value[:FIELD_CHARS] + "…" if len(value) > FIELD_CHARS else value


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


class TextFormatter(logging.Formatter):
    """The usual line, an access record's fields as ``key=value`` (a value with a space, a quote or a control
    character JSON-quoted, so one record is one line whatever a client named its model)."""

    def __init__(self) -> None:
        super().__init__(_TEXT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={_text(v)}" for k, v in fields.items())
        return line


def _text(value: Any) -> str:
    s = value if type(value) is str else str(value)
    if s and s.isprintable() and " " not in s and '"' not in s and "=" not in s:
        return s
    return printable(orjson.dumps(s).decode())  # (JSON escapes the controls; \uXXXX what else is not printable)


def configure(level: str = "info", fmt: str = "text", access_log: bool = True) -> None:
    handler = logging.StreamHandler()
    ACCESS_LOG.stream, ACCESS_LOG.json = handler.stream, fmt == "json"
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("alembic").setLevel(logging.WARNING)
    ACCESS.disabled = not access_log
    ACCESS_LOG.on = ACCESS.isEnabledFor(logging.INFO)
