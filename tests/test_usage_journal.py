"""The usage journal's own contract (docs/operations/database.md#when-the-gateway-is-killed-the-journal); the
crash tests are in tests/test_shutdown.py."""

from __future__ import annotations

import os

import pytest

from fairgate.storage.usage_journal import Journal, JournalBusy


def test_a_journal_that_cannot_write_says_so_and_never_raises(tmp_path, caplog):
    """A full disk (here: the journal's file descriptor closed under it) fails its writes: ``append`` never
    raises (the request is answered, its row still goes to the database), logs once, and keeps the reason for
    /ready until a write works again; a second journal on the same path is refused."""
    j = Journal(tmp_path / "journal", fsync_s=0)
    with pytest.raises(JournalBusy):
        Journal(tmp_path / "journal")
    j.append(b'{"a": 1}\n')
    assert j.error is None and j.rows == 1
    os.close(j._fd)
    j._fd = os.open(os.devnull, os.O_RDONLY)  # (writes now fail with EBADF, as a full disk fails them)
    j.append(b'{"a": 2}\n')
    j.append(b'{"a": 3}\n')
    assert j.error is not None and j.rows == 1
    assert sum("could not be written" in r.message for r in caplog.records) == 1
    j.close()
