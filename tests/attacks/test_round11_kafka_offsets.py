"""Round 11 attacks on the Kafka runner with offsets in the database (issue 36): ownership.

On the real broker (Tansu) and PostgreSQL, through the public API only
(``KafkaConfig(offsets="database")``). Every race is forced: an old owner's event loop is
frozen inside a handler (a threading.Event), so it misses its session and the group gives
its partition to a new owner; a claim the new owner makes is seen waiting in
pg_stat_activity before the old owner is let go; the database is cut at the very statement
that takes a partition.

- a zombie holding its chunk's claims (``claim_ids=True``): the new owner waits on them, the
  zombie's offset write is fenced, its chunk rolls back, nothing is doubled;
- the partition's row deleted by hand while a zombie still runs its chunk: the new owner's
  fresh row must not carry an epoch the zombie holds (it did: epoch 1 again, so the zombie
  committed its chunk a second time and moved the offset back);
- the database away when a partition is assigned: the partition is not read (from the
  group's offset) before the database says where it starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import AsyncDeduplicator, Message, PermanentError
from tests.kafka.test_offsets_in_database import (
    DEADLINE,
    QUICK,
    applied,
    events,
    ledger_handler,
    make_runner,
    set_group_offset,
    stored,
    until,
)
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)
from tests.support.tcp_proxy import Proxy

pytestmark = pytest.mark.postgres


class FrozenOwner:
    """A runner in a thread of its own whose event loop freezes inside the handler of
    record ``n`` (after its ledger row), until ``thaw``: no heartbeat, the group moves on.
    A body with "fail" fails for good (PermanentError)."""

    def __init__(
        self, kafka: KafkaService, pg: Any, ledger: str, topic: str, group: str, **config: Any
    ) -> None:
        self.frozen, self.thaw = threading.Event(), threading.Event()
        self.runner: Any = None
        self.loop: asyncio.AbstractEventLoop | None = None
        args = (kafka, pg, ledger, topic, group, config)
        self.thread = threading.Thread(target=self._main, args=args, daemon=True)

    def start(self, n: int) -> None:
        self.n = n
        self.thread.start()

    def _main(
        self, kafka: KafkaService, pg: Any, ledger: str, topic: str, group: str, config: Any
    ) -> None:
        async def main() -> None:
            engine = pg.async_engine()
            dedup = AsyncDeduplicator(engine, consumer="ledger", tables=pg.tables, retry=QUICK)

            @dedup.handler
            async def handle(message: Message, session: Any) -> None:
                n = message.json()["n"]
                if message.json().get("fail"):
                    raise PermanentError("refused by the handler")
                columns = "(account, amount, message_id)"
                insert = f"INSERT INTO {ledger} {columns} VALUES ('old', :n, :m)"
                await session.execute(text(insert), {"n": n, "m": message.id})
                if n == self.n and not self.frozen.is_set():
                    self.frozen.set()
                    self.thaw.wait(DEADLINE)  # blocks the whole event loop: no heartbeat

            self.runner = make_runner(kafka, handle, topic, group, batch_size=10, **config)
            self.loop = asyncio.get_running_loop()
            try:
                await self.runner.run()
            finally:
                await engine.dispose()

        asyncio.run(main())

    async def stop(self) -> None:
        """Let it go, stop it (a deadline: a zombie rejoining may wait in its join)."""
        self.thaw.set()
        if self.loop is not None and self.runner is not None:
            self.loop.call_soon_threadsafe(self.runner.stop, 5.0)
        await asyncio.to_thread(self.thread.join, 30)
        assert not self.thread.is_alive(), "the old owner did not stop"


def waiting_claims(pg: Any) -> int:
    """Backends of this test's schema waiting on a lock in a claim (INSERT processed_events)."""
    return int(
        pg.scalar(  # type: ignore[call-overload]
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            f"AND query LIKE '%{pg.schema}.processed_events%' AND query ILIKE 'INSERT%'"
        )
    )


async def test_a_zombie_holding_its_claims_is_fenced_and_the_new_owner_waits_on_them(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """claim_ids=True: the old owner freezes in its third chunk with the claims of 20..29
    written and not committed. The new owner takes the next epoch, reads from 20, and its
    claim of e-0020 waits on the old owner's (seen in pg_stat_activity). The old owner is
    then let go: its offset write changes no row, its chunk rolls back (claims and ledger
    rows), and the new owner's claims go through. Each event once; the offset at 50."""
    ledger = pg.create_ledger()
    topic = await topics.create("zclaims")
    await topics.produce_many(topic, events(0, 50))
    group = "zclaims-" + topic
    old = FrozenOwner(kafka, pg, ledger, topic, group, claim_ids=True)
    old.start(25)
    engine = pg.async_engine()
    new = make_runner(
        kafka, ledger_handler(engine, pg.tables, ledger, "new"), topic, group, batch_size=10
    )
    new_task: asyncio.Task[None] | None = None
    try:
        await until(old.frozen.is_set, "the old owner to freeze in its third chunk")
        first_epoch = stored(pg, group, topic)[1]
        assert stored(pg, group, topic)[0] == 20
        new_task = asyncio.create_task(new.run())
        await until(lambda: stored(pg, group, topic)[1] > first_epoch, "the new owner's epoch")
        await until(lambda: waiting_claims(pg) > 0, "the new owner's claim to wait on the old")
        old.thaw.set()
        # The old owner rejoins once let go: either may own the partition from then on.
        await until(lambda: stored(pg, group, topic)[0] == 50, "the offset at the end")
    finally:
        await old.stop()
        new.stop()
        if new_task is not None:
            await asyncio.wait_for(new_task, 30)
        await engine.dispose()
    mine = [eid for eid, _ in events(0, 50)]
    assert sorted(applied(pg, ledger)) == mine  # once each: the frozen chunk rolled back
    assert "e-0020" in applied(pg, ledger, "new")  # its claim went through after the fence
    processed = pg.scalar(f"SELECT count(*) FROM {pg.name('processed_events')}")
    assert processed == 50


async def test_a_row_deleted_by_hand_gives_no_zombie_its_epoch_back(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    """Offsets only. The old owner (epoch taken on a fresh row) freezes in its third chunk;
    an operator deletes the group's rows (as docs/kafka.md says to do for a topic made
    again); the new owner finds no row and makes one. Its epoch must not be one the old
    owner holds: before, both were 1, so the thawed zombie's write matched, its chunk
    committed a second time (20..29 doubled) and set the offset back from 50 to 30."""
    ledger = pg.create_ledger()
    topic = await topics.create("aba")
    await topics.produce_many(topic, events(0, 50))
    group = "aba-" + topic
    old = FrozenOwner(kafka, pg, ledger, topic, group, claim_ids=False)
    old.start(25)
    engine = pg.async_engine()
    new = make_runner(
        kafka,
        ledger_handler(engine, pg.tables, ledger, "new"),
        topic,
        group,
        batch_size=10,
        claim_ids=False,
    )
    new_task: asyncio.Task[None] | None = None
    try:
        await until(old.frozen.is_set, "the old owner to freeze in its third chunk")
        assert stored(pg, group, topic)[0] == 20
        with pg.engine.begin() as conn:
            conn.execute(
                text(f"DELETE FROM {pg.name('consumer_offsets')} WHERE consumer_group = :g"),
                {"g": group},
            )
        new_task = asyncio.create_task(new.run())
        await until(lambda: len(applied(pg, ledger, "new")) == 30, "the new owner to finish")
        await until(lambda: stored(pg, group, topic)[0] == 50, "the new owner's offset")
        old.thaw.set()
        # The old owner's chunk ends one way or the other once it is let go and stopped.
    finally:
        await old.stop()
        new.stop()
        if new_task is not None:
            await asyncio.wait_for(new_task, 30)
        await engine.dispose()
    mine = [eid for eid, _ in events(0, 50)]
    assert sorted(applied(pg, ledger)) == mine  # once each: the zombie's chunk rolled back
    assert stored(pg, group, topic)[0] == 50  # not moved back by the zombie


@pytest.mark.parametrize("broker_at", [10, 45], ids=["broker-behind", "broker-ahead"])
async def test_the_database_away_at_assignment_reads_nothing_before_it_answers(
    kafka: KafkaService,
    topics: Topics,
    pg: Any,
    caplog: pytest.LogCaptureFixture,
    broker_at: int,
) -> None:
    """The database (30) and the group's broker offset (10: a replay would double 10..29;
    45: reading from it would skip 30..44) differ. The second consumer's engine goes
    through a proxy cut at the very statement that takes the partition (its epoch bump):
    the partition stays paused, nothing is read from the broker's offset; once the
    database is back it starts at 30."""
    caplog.set_level(logging.INFO, logger="consumerdedup")
    ledger = pg.create_ledger()
    topic = await topics.create("dbaway")
    group = "dbaway-" + topic
    engine = pg.async_engine()
    try:
        await topics.produce_many(topic, events(0, 30))
        first = make_runner(
            kafka, ledger_handler(engine, pg.tables, ledger, "first"), topic, group, claim_ids=False
        )
        await asyncio.wait_for(first.run(until_idle=True), DEADLINE)
        assert stored(pg, group, topic)[0] == 30
    finally:
        await engine.dispose()
    await topics.produce_many(topic, events(30, 60))
    await set_group_offset(kafka, group, topic, broker_at)

    proxy = Proxy("127.0.0.1", 5432)
    url = pg.async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    assert url != pg.async_url
    away = create_async_engine(url)
    cut = threading.Event()

    @event.listens_for(away.sync_engine, "before_cursor_execute")
    def cut_at_the_take(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not cut.is_set() and statement.startswith("UPDATE") and "consumer_offsets" in statement:
            cut.set()
            proxy.cut()  # the statement goes to a connection that is gone

    calls: list[str] = []
    second = make_runner(
        kafka,
        ledger_handler(away, pg.tables, ledger, "second", calls),
        topic,
        group,
        claim_ids=False,
    )
    task = asyncio.create_task(second.run(until_idle=True))
    try:
        await until(
            lambda: any("could not be read" in r.getMessage() for r in caplog.records),
            "the take to fail with the database away",
        )
        assert calls == []  # paused: nothing read from the group's offset meanwhile
        proxy.restore()
        await asyncio.wait_for(task, DEADLINE)
    finally:
        proxy.cut()
        if not task.done():
            second.stop()
            await asyncio.wait_for(task, 30)
        await away.dispose()
    assert calls == [eid for eid, _ in events(30, 60)]
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 60)]
    assert stored(pg, group, topic)[0] == 60
    said = [r.getMessage() for r in caplog.records if "starts at" in r.getMessage()]
    assert any("offset 30: the database" in line for line in said), said


async def test_the_database_away_at_the_offset_write_after_a_dead_letter_doubles_nothing(
    kafka: KafkaService, topics: Topics, pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """With claims. The chunk [e-0010, e-0011 that fails] commits e-0010 and e-0011's FAILED
    record with the offset held at 11 (before the FAILED record, until its dead letter is
    sent); the runner then sends the letter and moves the offset to 12 in a write of its
    own, and the database is cut at that very write. Read again, nothing is applied twice
    (e-0010 DUPLICATE), the letter is sent at least once, the offset ends at 12."""
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    ledger = pg.create_ledger()
    topic = await topics.create("advance")
    group = "advance-" + topic
    engine = pg.async_engine()
    options = {"claim_ids": True, "batch_size": 2}
    try:
        await topics.produce_many(topic, events(0, 10))
        first = make_runner(
            kafka, ledger_handler(engine, pg.tables, ledger, "first"), topic, group, **options
        )
        await asyncio.wait_for(first.run(until_idle=True), DEADLINE)
        assert stored(pg, group, topic)[0] == 10
    finally:
        await engine.dispose()
    await topics.produce(topic, json.dumps({"n": 10}).encode(), event_id="e-0010")
    await topics.produce(topic, json.dumps({"n": 11, "fail": True}).encode(), event_id="e-0011")

    proxy = Proxy("127.0.0.1", 5432)
    url = pg.async_url.replace("127.0.0.1:5432", f"127.0.0.1:{proxy.port}")
    away = create_async_engine(url)
    committed, cut = threading.Event(), threading.Event()

    @event.listens_for(away.sync_engine, "before_cursor_execute")
    def cut_at_the_advance(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if (
            committed.is_set()
            and not cut.is_set()
            and "consumer_offsets SET next_offset" in (" ".join(statement.split()))
        ):
            cut.set()
            proxy.cut()

    second = make_runner(
        kafka,
        ledger_handler(away, pg.tables, ledger, "second"),
        topic,
        group,
        before_ack=lambda results: committed.set(),
        **options,
    )
    task = asyncio.create_task(second.run(until_idle=True))
    try:
        await until(cut.is_set, "the runner's own offset write to meet the cut")
        await until(
            lambda: any("not written" in r.getMessage() for r in caplog.records),
            "the runner to give the write up for now",
        )
        proxy.restore()
        await asyncio.wait_for(task, DEADLINE)
    finally:
        proxy.cut()
        if not task.done():
            second.stop()
            await asyncio.wait_for(task, 30)
        await away.dispose()
    assert sorted(applied(pg, ledger)) == [eid for eid, _ in events(0, 11)]  # once each
    assert stored(pg, group, topic)[0] == 12
    dead = {dict(r.headers)["event_id"] for r in await topics.records(topic + ".dlq")}
    assert dead == {b"e-0011"}
