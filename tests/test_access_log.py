"""The access record: one bounded line per request, built from its usage row, in the text or the JSON format;
each value a client names is clipped and, in text, quoted where it would break the ``key=value`` line."""

from __future__ import annotations

import io
import json
from datetime import datetime, timedelta, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from fairgate.logs import FIELD_CHARS, FIELDS, NAMES, AccessLog, _clip, _text, _text_fields

T0 = datetime(2026, 11, 30, 10, 0, 0, 123456, tzinfo=timezone.utc)


def row(**over) -> dict:
    base = dict(arrival=T0, dispatched_at=T0, finished_at=T0 + timedelta(microseconds=3_250),
                request_id="req-0123456789abcdef", client_request_id=None, app="chat", user=None, endpoint="chat",
                model="m", stream=True, backend="gpu-0", status="ok", http_status=200, throttle_reason=None,
                prompt_tokens=14, cached_tokens=0, completion_tokens=64, queue_wait_ms=0.1234, attempts=1,
                error=None)
    return {**base, **over}


def written(log: AccessLog, *records) -> list[str]:
    log.on, log.stream = True, io.StringIO()
    for r, interaction, first in records:
        log.record(r, interaction, first)
    log.flush()
    return log.stream.getvalue().splitlines()


def test_a_text_record_holds_what_the_request_did():
    (line,) = written(AccessLog(), (row(), None, T0 + timedelta(microseconds=1_960)))
    assert " INFO fairgate.access: request request_id=req-0123456789abcdef app=chat endpoint=chat model=m " in line
    assert line.endswith(" stream=True backend=gpu-0 status=ok http_status=200 prompt_tokens=14 cached_tokens=0 "
                         "completion_tokens=64 queue_wait_ms=0.1 ttft_ms=2.0 latency_ms=3.2 attempts=1")
    assert "user=" not in line and "error=" not in line  # (absent: not written)


def test_names_a_client_chose_are_clipped_and_quoted():
    hostile = row(model='a "model"=x ' + "y" * 1000, user="", client_request_id="id\u202eevil\u2028x\x85y",
                  error="backend gpu-0: HTTP 500")
    (line,) = written(AccessLog(), (hostile, "chat 1", None))
    model = '"a \\"model\\"=x ' + "y" * (FIELD_CHARS - len('a "model"=x ')) + '…"'  # (clipped, then quoted)
    # (what is not printable is written out: a bidi override, a line separator, NEL never reach a reader raw)
    assert len(line.splitlines()) == 1 and line.isprintable()
    assert f' client_request_id="id\\u202eevil\\u2028x\\u0085y" app=chat user="" interaction="chat 1" endpoint=chat model={model} ' in line
    assert line.endswith(' error="backend gpu-0: HTTP 500"') and "ttft_ms" not in line and len(line) < 700


def test_a_json_record_is_one_object_with_numbers():
    log = AccessLog()
    log.json = True
    (line,) = written(log, (row(model="x" * 1000), "i-1", T0 + timedelta(microseconds=1_960)))
    doc = json.loads(line)
    assert (doc["logger"], doc["message"], doc["interaction"], doc["ttft_ms"], doc["latency_ms"]) == (
        "fairgate.access", "request", "i-1", 2.0, 3.2)
    assert doc["queue_wait_ms"] == 0.1 and len(doc["model"]) == FIELD_CHARS + 1 and "user" not in doc


names = st.one_of(st.none(), st.text(max_size=300),
                  st.sampled_from(["", " ", "a=b", 'q"', "ok", "x" * 256, "x" * 257, "é\u202e", "\x00"]))
numbers = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40), st.floats(allow_nan=True))


@settings(max_examples=400, deadline=None)
@given(st.tuples(*(names if k in NAMES else numbers for k in FIELDS)))
def test_every_record_writes_each_value_as_the_per_field_rule_does(vals):
    """The fields as written (most records: their names checked all at once) equal the rule applied field by
    field."""
    expected = " ".join(f"{k}={_text(_clip(v)) if type(v) is str else v}" for k, v in zip(FIELDS, vals)
                        if v is not None)
    assert _text_fields(vals) == expected


def test_a_record_of_a_real_call_holds_names_only_where_the_record_checks_them():
    """What the all-at-once check relies on: of a call's usage row, only the fields in NAMES are strings."""
    from fairgate.proxy.call import Call, new_request_id

    call = Call(new_request_id(), "chat", app="chat", user="ann", model="m", backend="gpu-0", stream=True,
                dispatched_at=T0, first_token_at=T0, finished_at=T0, queue_wait_s=0.001)
    r = call.row()
    others = {"stream": r["stream"], "http_status": r["http_status"], "prompt_tokens": r["prompt_tokens"],
              "cached_tokens": r["cached_tokens"], "completion_tokens": r["completion_tokens"],
              "queue_wait_ms": r["queue_wait_ms"], "attempts": r["attempts"]}
    assert set(others) | set(NAMES) | {"ttft_ms", "latency_ms"} == set(FIELDS)
    assert not any(isinstance(v, str) for v in others.values()), others
