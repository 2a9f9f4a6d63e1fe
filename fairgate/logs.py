"""The gateway's logs: one line per record, as text or JSON lines (``serve --log-format``), and the access
log — one record per request that carried a valid key, at info on the ``fairgate.access`` logger: ids,
tenant, model, backend, outcome, tokens, queue wait and latency; never a key, a prompt or a completion.
Requests refused before a key was checked (401) are counted in ``fairgate_auth_failures_total`` instead,
so a keyless flood cannot fill the disk.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any

import orjson

ACCESS = logging.getLogger("fairgate.access")
FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELD_CHARS = 256  # the usage log's widest id column


def access(call) -> None:
    """Write ``call``'s access record (a ``proxy.call.Call`` whose usage row was just submitted)."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    t = call.tally
    since = lambda at: None if at is None else round((at - call.arrival).total_seconds() * 1000.0, 1)  # noqa: E731
    fields = {
        "request_id": call.request_id, "client_request_id": call.client_request_id, "app": call.app,
        "user": call.user, "interaction": call.interaction or None, "endpoint": call.endpoint, "model": call.model,
        "stream": call.stream, "backend": call.backend, "status": call.status, "http_status": call.http_status,
        "reason": call.throttle_reason, "prompt_tokens": t.prompt_tokens if call.dispatched_at else 0,
        "cached_tokens": t.cached_tokens, "completion_tokens": t.completion_tokens,
        "queue_wait_ms": None if call.queue_wait_s is None else round(call.queue_wait_s * 1000.0, 1),
        "ttft_ms": since(call.first_token_at), "latency_ms": since(call.finished_at), "attempts": len(call.attempts),
        "error": call.error,
    }
    ACCESS.info("request", extra={"fields": {k: _clip(v) for k, v in fields.items() if v is not None}})


def _clip(value: Any) -> Any:
    """A client-named string (its model, say) at most FIELD_CHARS long: a record stays one bounded line."""
    return value[:FIELD_CHARS] + "…" if isinstance(value, str) and len(value) > FIELD_CHARS else value


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
    s = str(value)
    if s and s.isprintable() and not any(c in s for c in ' "='):
        return s
    return orjson.dumps(s).decode()


def configure(level: str = "info", fmt: str = "text", access_log: bool = True) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.getLogger("alembic").setLevel(logging.WARNING)
    ACCESS.disabled = not access_log
