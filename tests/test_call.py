"""A request's record: its status is one of the usage log's, and its usage row has every column the model has."""

from __future__ import annotations

from fairgate.proxy.call import Attempt, Call
from fairgate.proxy.control.backends import Backend
from fairgate.storage.models import Status, UsageLog


def test_the_usage_row_is_the_models_columns_and_the_status_one_of_its_values():
    call = Call("req-1", "chat", app="a", user="u")
    call.fail(Status.THROTTLED, 429, "slow down " * 500)
    row = call.row()
    assert set(row) == {c.name for c in UsageLog.__table__.columns} - {"id"}
    assert row["status"] == "throttled" and type(row["status"]) is str and len(row["error"]) == 2000
    assert row["interaction"] == "req-1" and row["prompt_tokens"] == 0
    assert {s.value for s in Status} == {"ok", "error", "cancelled", "throttled", "rejected"}
    b0, b1 = Backend("b0", "http://127.0.0.1:1"), Backend("b1", "http://127.0.0.1:2")
    call.attempts += [Attempt(b0, 1.0, error="backend b0: refused"), Attempt(b1, 1.2)]
    assert call.row()["attempts"] == 2
