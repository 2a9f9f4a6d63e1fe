"""The usage journal's own contract (docs/operations/database.md#the-usage-journal-outages-and-crashes); the
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


class _Disk(Journal):
    """The journal as its disk holds it: of each segment, the bytes an ``fsync`` has covered (all a power loss
    leaves). Sizes are taken before each sync, so what is counted durable was written before it began."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.durable: dict = {}

    def sync(self) -> None:
        sizes = {p: p.stat().st_size for _, p in self.segments()}
        super().sync()
        self.durable.update(sizes)


async def test_a_power_loss_during_an_outage_loses_at_most_the_last_fsync_interval(pg_url, tmp_path):
    """PostgreSQL away (the rows wait in the journal), 200 rows a second for three seconds, then the machine
    loses power: each segment keeps only what an fsync covered. Started again with the database back, every row
    but those of the last ``usage_journal_fsync_s`` (and the sync under way) is written, once."""
    import asyncio

    from fairgate.proxy.call import Call
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.usage_queries import rows as all_rows
    from fairgate.storage.usage_writer import UsageWriter
    from tests.tcp_proxy import TcpProxy

    fsync_s, rate = 0.25, 200
    proxy = await TcpProxy("127.0.0.1", 5432).start()
    engine = make_engine(pg_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}"))
    await ensure_schema(engine)
    journal = _Disk(tmp_path / "journal", fsync_s=fsync_s)
    writer = UsageWriter(sessionmaker(engine), interval_s=0.05, journal=journal)
    await writer.start()
    await proxy.cut()
    loop = asyncio.get_running_loop()
    when: dict[str, float] = {}
    for i in range(3 * rate):
        writer.submit(Call(f"r{i}", "chat", app="a").row())
        when[f"r{i}"] = loop.time()
        await asyncio.sleep(1 / rate)
    lost_at = loop.time()
    writer._task.cancel()  # the power is gone: nothing more runs, and the disk keeps what was synced
    durable = dict(journal.durable)
    for _, path in journal.segments():
        os.truncate(path, durable.get(path, 0))
    os.close(journal._lock)
    assert writer.on_disk > rate  # (the rows had left memory for the journal)

    await proxy.start()  # the machine back, and the database
    again = UsageWriter(sessionmaker(engine), journal=Journal(tmp_path / "journal"))
    await again.start()
    await again.close()
    ids = [r["request_id"] for r in await all_rows(again.sessions)]
    await engine.dispose()
    await proxy.cut()
    lost = set(when) - set(ids)
    assert len(ids) == len(set(ids)) and set(ids) <= set(when)
    # (the interval, the sync under way when the power went, and a loop turn's lag on a busy machine)
    window = fsync_s + 0.25
    assert all(when[r] > lost_at - window for r in lost), sorted(lost_at - when[r] for r in lost)[-3:]
    assert len(lost) <= rate * window, len(lost)


async def test_rows_an_earlier_version_kept_are_written_at_the_first_start(tmp_path, monkeypatch):
    """A version before 2026-11-28d kept an outage's rows in a spool file and the rest in a journal beside it
    (``usage_spool``): a gateway configured so moves both into its journal at start and writes them, once."""
    import orjson

    from fairgate.proxy.call import Call
    from tests.conftest import gateway_config, run_gateway

    monkeypatch.setenv("FAIRGATE_HOME", str(tmp_path / "home"))
    spool = tmp_path / "spool.jsonl"
    spool.write_bytes(b"".join(orjson.dumps(Call(f"s{i}", "chat", app="a").row(), default=str) + b"\n"
                               for i in range(3)))
    (tmp_path / "spool.jsonl.journal.4").write_bytes(orjson.dumps(Call("j0", "chat", app="a").row(),
                                                                  default=str) + b"\n")
    cfg = gateway_config(f"sqlite:///{tmp_path}/fairgate.db", usage_journal=f"{spool}.journal")
    async with run_gateway(cfg) as gw:
        ids = sorted(r["request_id"] for r in await gw.rows())
    assert ids == ["j0", "s0", "s1", "s2"] and not spool.exists()


async def test_an_outage_that_returns_during_a_replay_loses_no_row(tmp_path):
    """The database goes, comes back for a moment (the older rows are written again), goes again before the
    rows queued during the outage are, then comes back for good: every row is written, once. (The writer once
    counted the rows it replayed against the rows it had left out of memory, believed itself done, and deleted
    a segment it had not written.)"""
    from fairgate.proxy.call import Call
    from fairgate.storage.db import ensure_schema, make_engine, sessionmaker
    from fairgate.storage.usage_queries import rows as all_rows
    from fairgate.storage.usage_writer import UsageWriter

    engine = make_engine(f"sqlite:///{tmp_path}/fairgate.db")
    await ensure_schema(engine)
    writer = UsageWriter(sessionmaker(engine), batch_size=2, journal=Journal(tmp_path / "journal", fsync_s=0))
    real, down = writer._insert, [False]

    async def insert(rows):
        if down[0]:
            raise OSError("the database is away")
        await real(rows)

    async def reachable() -> bool:
        return not down[0]

    writer._insert, writer._reachable = insert, reachable
    calls = iter(range(100))

    def submit(n: int) -> None:
        for _ in range(n):
            writer.submit(Call(f"r{next(calls)}", "chat", app="a").row())

    submit(3)
    real_write = writer._write
    written = [0]

    async def write(rows):  # the database goes after the first batch of two
        left = await real_write(rows)
        written[0] += 1
        down[0] = True
        return left

    writer._write = write
    assert not await writer.flush()  # r0, r1 written; r2 left, with the rest, to the journal
    writer._write = real_write
    submit(1)  # r3, during the outage
    assert not await writer.flush()
    down[0] = False
    replayed = 0

    async def flaky(rows):  # back for the older segment's two batches, away again for the next segment
        nonlocal replayed
        replayed += 1
        if replayed > 2:
            down[0] = True
        return await real_write(rows)

    writer._write = flaky
    assert not await writer.flush()
    writer._write, down[0] = real_write, False
    submit(1)  # r4
    assert await writer.flush()
    ids = sorted(r["request_id"] for r in await all_rows(writer.sessions))
    await writer.close()
    await engine.dispose()
    assert ids == [f"r{i}" for i in range(5)], ids
