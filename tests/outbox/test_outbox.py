"""Outbox.add and OutboxRelay against SQLite, PostgreSQL and MariaDB, publishing to the
MemoryBroker; the concurrent scenarios on PostgreSQL and MariaDB (true concurrent writers)."""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncPublisher,
    BrokerUnavailable,
    ConfigurationError,
    Deduplicator,
    DestinationMissing,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    Publisher,
    RelayConfig,
    SimulatedCrash,
)
from consumerdedup.headers import ID_HEADER
from consumerdedup.testing import MemoryBroker
from tests.outbox.conftest import installed
from tests.support.outbox_events import running


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    yield from installed(request, request.param, tmp_path)


QUICK = RelayConfig(
    batch_size=50,
    poll_interval=timedelta(seconds=30),
    initial_backoff=timedelta(0),
    max_backoff=timedelta(0),
    max_attempts=3,
)


def outbox_rows(db: Any) -> list[Any]:
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        return list(conn.execute(select(ob).order_by(ob.c.id)))


def add_events(db: Any, events: list[tuple[str, str | None]], topic: str = "orders") -> list[str]:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        return [outbox.add(session, topic, body.encode(), key=key) for body, key in events]


def test_rollback_leaves_no_event_and_commit_leaves_exactly_one(db: Any) -> None:
    ledger = db.create_ledger()
    outbox = Outbox(db.tables)
    with Session(db.engine) as session:
        session.execute(text(f"INSERT INTO {ledger} VALUES ('a', 1, 'm-1')"))
        outbox.add(session, "orders", b"{}", key="a")
        session.rollback()
    assert outbox_rows(db) == []
    with Session(db.engine) as session, session.begin():
        session.execute(text(f"INSERT INTO {ledger} VALUES ('a', 1, 'm-1')"))
        event_id = outbox.add(session, "orders", b'{"n": 1}', key="a", headers={"trace": "t1"})
    [row] = outbox_rows(db)
    assert row.event_id == event_id and row.key == "a" and row.body == b'{"n": 1}'
    assert row.headers == {"trace": "t1", ID_HEADER: event_id}
    assert row.published_at is None and row.attempts == 0


def test_event_ids_are_unique_and_time_ordered(db: Any) -> None:
    ids = add_events(db, [(f"{n}", None) for n in range(200)])
    assert len(set(ids)) == 200
    assert ids == sorted(ids)  # UUIDv7: creation order is string order


def test_a_handler_writes_and_emits_in_one_transaction(db: Any) -> None:
    """The downstream consumer dedups what the relay publishes, by event_id."""
    ledger = db.create_ledger()
    broker = MemoryBroker()
    outbox = Outbox(db.tables)
    orders = Deduplicator(db.engine, consumer="orders", tables=db.tables)

    @orders.handler
    def place(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} VALUES ('o', 1, :m)"), {"m": message.id})
        outbox.add(session, "shipping", message.body, key="customer-1")

    assert place(Message(id="order-1", body=b"{}")) is Outcome.PROCESSED
    assert place(Message(id="order-1", body=b"{}")) is Outcome.DUPLICATE
    relay = OutboxRelay(db.engine, broker, tables=db.tables, config=QUICK)
    assert relay.drain() == 1
    assert relay.drain() == 0
    [event] = broker.messages("shipping")
    assert event.id == outbox_rows(db)[0].event_id
    assert outbox_rows(db)[0].published_at is not None


async def test_add_with_an_async_session(db: Any) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession

    engine = db.async_engine()
    outbox = Outbox(db.tables)
    async with AsyncSession(engine) as session, session.begin():
        event_id = await outbox.add(session, "orders", b"x", key="k")
    await engine.dispose()
    assert [r.event_id for r in outbox_rows(db)] == [event_id]


def test_relay_publishes_each_key_in_order_and_marks_rows(db: Any) -> None:
    ids = add_events(db, [(f"e{n}", f"k{n % 3}") for n in range(120)])
    broker = MemoryBroker()
    relay = OutboxRelay(db.engine, broker, tables=db.tables, config=QUICK)
    assert relay.run_once() == 50
    assert relay.drain() == 70
    published = broker.messages("orders")
    assert sorted(m.id for m in published) == sorted(ids)
    for key in range(3):
        of_key = [int(m.body[1:]) for m in published if int(m.body[1:]) % 3 == key]
        assert of_key == sorted(of_key)
    assert all(r.published_at is not None for r in outbox_rows(db))


@pytest.mark.parametrize("step", ["run_once", "run"])
def test_a_relay_without_its_outbox_stops_at_start_naming_it(db: Any, step: str) -> None:
    """Doctor's start check (issue 23): the missing table and the fix, before any round;
    a relay needs its outbox only (processed_events is dropped too, and not asked for)."""
    for table in ("outbox", "processed_events"):
        with db.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {db.name(table)}")
    relay = OutboxRelay(db.engine, MemoryBroker(), tables=db.tables, config=QUICK)
    with pytest.raises(ConfigurationError) as refused:
        getattr(relay, step)()
    said = str(refused.value)
    assert db.tables.outbox.fullname in said and "consumerdedup init-db" in said
    assert db.tables.processed_events.fullname not in said


def test_delete_published_removes_rows(db: Any) -> None:
    add_events(db, [("a", None), ("b", None)])
    config = RelayConfig(batch_size=10, delete_published=True)
    relay = OutboxRelay(db.engine, MemoryBroker(), tables=db.tables, config=config)
    assert relay.drain() == 2
    assert outbox_rows(db) == []


class FlakyPublisher(Publisher):
    """Fails chosen events a number of times, the way a refusing broker would."""

    def __init__(self, failures: dict[str, int], error: type[Exception] = ValueError) -> None:
        self.broker = MemoryBroker()
        self.failures = dict(failures)
        self.error = error
        self.calls: list[str] = []

    def publish(
        self, destination: str, body: bytes, key: str | None = None, headers: Any = None
    ) -> None:
        self.calls.append(body.decode())
        if self.failures.get(body.decode(), 0) > 0:
            self.failures[body.decode()] -= 1
            raise self.error(f"refused {body.decode()}")
        self.broker.publish(destination, body, key, headers)


def test_a_failing_event_holds_back_its_key_only(db: Any) -> None:
    add_events(db, [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"), ("n1", None)])
    publisher = FlakyPublisher({"a1": 1})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    assert relay.run_once() == 3
    published = [m.body.decode() for m in publisher.broker.messages("orders")]
    assert published == ["b1", "b2", "n1"]  # a2 waits behind a1
    row = next(r for r in outbox_rows(db) if r.body == b"a1")
    assert row.attempts == 1 and "refused a1" in row.last_error
    assert relay.drain() == 2
    published = [m.body.decode() for m in publisher.broker.messages("orders")]
    assert published == ["b1", "b2", "n1", "a1", "a2"]


def test_an_event_that_keeps_failing_is_parked_and_reported(
    db: Any, caplog: pytest.LogCaptureFixture
) -> None:
    add_events(db, [("p1", "p"), ("p2", "p"), ("q1", "q")])
    publisher = FlakyPublisher({"p1": 99})
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    for _ in range(QUICK.max_attempts + 2):
        relay.run_once()
    assert publisher.calls.count("p1") == QUICK.max_attempts  # then no longer tried
    [(_, error)] = relay.parked()
    assert "refused p1" in (error or "")
    assert "parked" in caplog.text
    # Never dropped, and the key's later event stays behind it: order over progress.
    assert [m.body for m in publisher.broker.messages("orders")] == [b"q1"]
    assert relay.backlog() == 1  # p2


def test_broker_away_ends_the_round_and_nothing_is_lost(db: Any) -> None:
    add_events(db, [(f"e{n}", None) for n in range(10)])
    publisher = FlakyPublisher({"e3": 2}, error=ConnectionError)
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    assert relay.run_once() == 3  # e0..e2, then the broker went away: stop the round
    assert publisher.calls == ["e0", "e1", "e2", "e3"]
    assert relay.drain() == 0  # still away: drain() stops rather than spin
    assert all(r.attempts == 0 for r in outbox_rows(db))  # an outage charges no row
    assert relay.drain() == 7  # back
    assert sorted(m.body.decode() for m in publisher.broker.messages("orders")) == sorted(
        f"e{n}" for n in range(10)
    )


class TopicGone(DestinationMissing, TimeoutError):
    """How a client library may put it: "retry later", about a destination that is not there."""


def test_a_missing_destination_is_charged_to_its_event_and_the_other_keys_go(db: Any) -> None:
    add_events(db, [("a1", "a"), ("b1", "b"), ("a2", "a"), ("n1", None)])
    publisher = FlakyPublisher({"a1": 1}, error=TopicGone)
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    assert relay.run_once() == 2
    assert [m.body.decode() for m in publisher.broker.messages("orders")] == ["b1", "n1"]
    row = next(r for r in outbox_rows(db) if r.body == b"a1")
    assert row.attempts == 1 and "TopicGone" in row.last_error


def test_broker_unavailable_charges_no_event(db: Any) -> None:
    add_events(db, [("a1", "a"), ("b1", "b")])
    publisher = FlakyPublisher({"a1": 1}, error=BrokerUnavailable)
    relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    assert relay.run_once() == 0
    assert publisher.calls == ["a1"]  # the round ended there
    assert all(r.attempts == 0 for r in outbox_rows(db))


def test_relay_killed_after_confirmation_republishes_and_downstream_dedups(db: Any) -> None:
    ledger = db.create_ledger()
    add_events(db, [("e0", None), ("e1", None)])
    broker = MemoryBroker()

    class DiesAfterConfirm(Publisher):
        def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None):  # type: ignore[no-untyped-def]
            broker.publish(destination, body, key, headers)  # confirmed...
            raise SimulatedCrash("killed before marking the row published")

    with pytest.raises(SimulatedCrash):
        OutboxRelay(db.engine, DiesAfterConfirm(), tables=db.tables, config=QUICK).run_once()
    assert all(r.published_at is None for r in outbox_rows(db))
    OutboxRelay(db.engine, broker, tables=db.tables, config=QUICK).drain()
    deliveries = broker.messages("orders")
    assert [m.body for m in deliveries] == [b"e0", b"e0", b"e1"]  # e0 twice: at least once

    downstream = Deduplicator(db.engine, consumer="downstream", tables=db.tables)

    @downstream.handler
    def apply(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} VALUES ('d', 1, :m)"), {"m": message.id})

    outcomes = [apply(m) for m in deliveries]
    assert outcomes == [Outcome.PROCESSED, Outcome.DUPLICATE, Outcome.PROCESSED]
    assert db.scalar(f"SELECT count(*) FROM {ledger}") == 2


def test_three_relays_at_once_keep_per_key_order_and_publish_everything(server: Any) -> None:
    pg = server
    keys = [f"k{n}" for n in range(60)]
    events = [(f"{keys[n % 60]}:{n}", keys[n % 60]) for n in range(2400)] + [
        (f"none:{n}", None) for n in range(100)
    ]
    for start in range(0, len(events), 250):
        add_events(pg, events[start : start + 250])
    broker = MemoryBroker()
    config = RelayConfig(batch_size=40, poll_interval=timedelta(seconds=0.05))
    relays = [OutboxRelay(pg.engine, broker, tables=pg.tables, config=config) for _ in range(3)]
    with running(relays):
        assert relays[0].wait_drained(120)
    assert sum(relay.published for relay in relays) == len(events)  # none published twice
    assert all(relay.published > 0 for relay in relays), [r.published for r in relays]
    seen: dict[str, list[int]] = defaultdict(list)
    for message in broker.messages("orders"):
        key, n = message.body.decode().split(":")
        seen[key].append(int(n))
    assert sum(len(v) for v in seen.values()) == len(events)
    for key in keys:
        assert seen[key] == sorted(seen[key]), f"key {key} out of order"


SESSION_ID = {"postgresql": "SELECT pg_backend_pid()", "mysql": "SELECT CONNECTION_ID()"}


def waits_on_a_lock(pg: Any, pid: int, returned: Any) -> bool:
    """True once backend ``pid`` waits on a lock (PostgreSQL: the key's advisory lock;
    MariaDB: the row lock of the key's bucket); False as soon as ``returned()`` says its
    add() went through without waiting."""
    if pg.dialect == "postgresql":
        asked, waiting = f"SELECT wait_event_type FROM pg_stat_activity WHERE pid = {pid}", "Lock"
    else:
        asked = (
            f"SELECT trx_state FROM information_schema.innodb_trx WHERE trx_mysql_thread_id = {pid}"
        )
        waiting = "LOCK WAIT"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if returned():
            return False
        if pg.scalar(asked) == waiting:
            return True
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} neither returned from add() nor waited on a lock")


def test_same_key_producers_commit_in_id_order(server: Any) -> None:
    """A second transaction adding the same key waits for the first to commit."""
    pg = server
    outbox = Outbox(pg.tables)
    second_pid: list[int] = []
    second_done = threading.Event()

    def second() -> None:
        with Session(pg.engine) as session, session.begin():
            second_pid.append(session.execute(text(SESSION_ID[pg.dialect])).scalar_one())
            outbox.add(session, "orders", b"second", key="k")
        second_done.set()

    thread = threading.Thread(target=second)
    with Session(pg.engine) as first:  # closed whatever fails: DROP SCHEMA must not wait on it
        try:
            outbox.add(first, "orders", b"first", key="k")
            thread.start()
            while not second_pid and thread.is_alive():
                time.sleep(0.005)
            assert second_pid, "the second producer died before its add()"
            waited = waits_on_a_lock(pg, second_pid[0], second_done.is_set)
            assert waited, "the second add() of key k returned while the first was open"
            first.commit()
        finally:
            first.rollback()  # a no-op after the commit; on a failure, frees the key
            thread.join(10)
    assert second_done.is_set()
    assert [r.body for r in outbox_rows(pg)] == [b"first", b"second"]


async def test_same_key_producers_commit_in_id_order_with_async_sessions(server: Any) -> None:
    """The same with AsyncSession: Outbox.add's async path takes the key lock too."""
    import asyncio

    pg = server

    from sqlalchemy.ext.asyncio import AsyncSession

    engine = pg.async_engine()
    outbox = Outbox(pg.tables)
    second_pid: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def second() -> None:
        async with AsyncSession(engine) as session, session.begin():
            pid = await session.execute(text(SESSION_ID[pg.dialect]))
            second_pid.set_result(pid.scalar_one())
            await outbox.add(session, "orders", b"second", key="k")

    try:
        async with AsyncSession(engine) as first:
            await outbox.add(first, "orders", b"first", key="k")
            task = asyncio.create_task(second())
            try:
                pid = await asyncio.wait_for(second_pid, 10)
                waited = await asyncio.to_thread(waits_on_a_lock, pg, pid, task.done)
                assert waited, "the second add() of key k returned while the first was open"
                await first.commit()
                await asyncio.wait_for(task, 10)
            finally:
                task.cancel()
                await first.rollback()
    finally:
        await engine.dispose()
    assert [r.body for r in outbox_rows(pg)] == [b"first", b"second"]


def test_producers_committing_while_relays_run_keep_each_keys_add_order(server: Any) -> None:
    """Four producers add events of five shared keys, each holding its transaction open a
    few ms after ``add``, while two relays publish. Per key, what the broker holds follows
    the order in which ``add`` returned (with the key lock, the order of the commits).

    One same-key race is forced first: producer 1's first add (key k0) starts after producer
    0's and is seen waiting on the key's lock before producer 0 commits; then all four run.
    Counting adds that took over 3 ms as 'waited' left it to the scheduler whether any
    producer really did.
    Which relay publishes an event is the scheduler's: every event once, in key order, is
    what is asserted of the two."""
    pg = server
    broker = MemoryBroker()
    config = RelayConfig(batch_size=20, poll_interval=timedelta(milliseconds=20))
    relays = [OutboxRelay(pg.engine, broker, tables=pg.tables, config=config) for _ in range(2)]
    outbox = Outbox(pg.tables)
    added: dict[str, float] = {}  # body: when add() returned (monotonic)
    first_added = threading.Event()  # producer 0 holds key k0, its transaction open
    second_pid: list[int] = []
    second_waited: list[bool] = []

    raced = threading.Event()  # then the other two join in (on MariaDB a third waiter on
    # k0's bucket row could hide producer 1's wait from information_schema.innodb_trx)

    def produce(producer: int) -> None:
        pause = random.Random(producer)
        if producer >= 2:
            assert raced.wait(60), "producers 0 and 1 never raced"  # a hang guard
        for i in range(60):
            key = "k0" if i == 0 and producer < 2 else f"k{pause.randrange(5)}"
            body = f"{key}:{producer}:{i}"
            with Session(pg.engine) as session, session.begin():
                if i == 0 and producer == 1:
                    second_pid.append(session.execute(text(SESSION_ID[pg.dialect])).scalar_one())
                    assert first_added.wait(60), "producer 0 never added"  # a hang guard
                outbox.add(session, "orders", body.encode(), key=key)
                added[body] = time.monotonic()
                if i == 0 and producer == 0:
                    first_added.set()
                    deadline = time.monotonic() + 60  # a hang guard, not a bound
                    while not second_pid:
                        assert time.monotonic() < deadline, "producer 1 never began"
                        time.sleep(0.005)  # polling a condition
                    try:
                        second_waited.append(
                            waits_on_a_lock(pg, second_pid[0], lambda: "k0:1:0" in added)
                        )
                    finally:
                        raced.set()
                time.sleep(pause.uniform(0.001, 0.008))  # committed a little later

    producers = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    with running(relays):
        for thread in producers:
            thread.start()
        for thread in producers:
            thread.join(60)
        assert relays[0].wait_drained(60)
    assert second_waited == [True], "producer 1's add of k0 did not wait on producer 0's"
    published = [m.body.decode() for m in broker.messages("orders")]
    assert sorted(published) == sorted(added)  # every event once
    assert added["k0:0:0"] < added["k0:1:0"]
    by_key: dict[str, list[str]] = defaultdict(list)
    for body in published:
        by_key[body.split(":")[0]].append(body)
    for key, bodies in by_key.items():
        assert bodies == sorted(bodies, key=added.__getitem__), f"key {key} out of add order"
    assert sum(relay.published for relay in relays) == len(added)


def test_an_idle_relay_is_woken_at_commit_not_by_the_poll_interval(server: Any) -> None:
    """PostgreSQL: the trigger's NOTIFY. MariaDB: a commit through Outbox.add in the relay's
    own process (others are found by polling)."""
    pg = server
    broker = MemoryBroker()
    config = RelayConfig(poll_interval=timedelta(seconds=60))
    relay = OutboxRelay(pg.engine, broker, tables=pg.tables, config=config)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        assert relay.wait_drained(10)  # idle now, listening
        started = time.monotonic()
        add_events(pg, [("hello", "k")])
        deadline = started + 10
        while not broker.messages("orders") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [m.body for m in broker.messages("orders")] == [b"hello"]
        assert time.monotonic() - started < 10 < config.poll_interval.total_seconds()
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize(
    "version",
    ["10.5.23-MariaDB-0+deb11u1", "8.0.0", "5.7.44-log", "10.4.32-MariaDB", "garbage"],
)
def test_a_server_without_skip_locked_is_refused_naming_its_version(version: str) -> None:
    from consumerdedup.outbox.mysql import refuse_without_skip_locked

    with pytest.raises(ConfigurationError) as refused:
        refuse_without_skip_locked(version, "OutboxRelay")
    assert version in str(refused.value) and "SKIP LOCKED" in str(refused.value)


@pytest.mark.parametrize("version", ["10.6.0-MariaDB", "10.11.19-MariaDB-0+deb12u1", "8.0.1"])
def test_a_server_with_skip_locked_is_taken(version: str) -> None:
    from consumerdedup.outbox.mysql import refuse_without_skip_locked

    refuse_without_skip_locked(version, "OutboxRelay")


def test_the_relay_on_mariadb_checks_the_server_at_start(mariadb: Any) -> None:
    """The floor is asked of the server itself (10.11 here: taken) before the first claim."""
    add_events(mariadb, [("a", "k")])
    relay = OutboxRelay(mariadb.engine, MemoryBroker(), tables=mariadb.tables, config=QUICK)
    asked: list[str] = []
    from sqlalchemy import event

    def seen(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        asked.append(statement)

    event.listen(mariadb.engine, "before_cursor_execute", seen)
    try:
        assert relay.drain() == 1
    finally:
        event.remove(mariadb.engine, "before_cursor_execute", seen)
    assert asked.index("SELECT VERSION()") < next(
        i for i, sql in enumerate(asked) if "SKIP LOCKED" in sql
    )


def test_wait_drained_with_a_background_relay(db: Any) -> None:
    broker = MemoryBroker()
    relay = OutboxRelay(
        db.engine,
        broker,
        tables=db.tables,
        config=RelayConfig(poll_interval=timedelta(seconds=0.05)),
    )
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        add_events(db, [(f"e{n}", None) for n in range(30)])
        assert relay.wait_drained(20)
        assert len(broker.messages("orders")) == 30
    finally:
        relay.stop()
        thread.join(10)
    with db.engine.connect() as conn:
        ob = db.tables.outbox
        unpublished = conn.execute(select(func.count()).where(ob.c.published_at.is_(None))).scalar()
    assert unpublished == 0


def test_an_async_publisher_runs_on_the_relays_own_loop(db: Any) -> None:
    import asyncio

    class AsyncMemoryPublisher(AsyncPublisher):
        def __init__(self) -> None:
            self.broker = MemoryBroker()
            self.loop: Any = None
            self.entered = self.exited = 0

        async def __aenter__(self) -> AsyncMemoryPublisher:
            self.entered += 1
            self.loop = asyncio.get_running_loop()
            return self

        async def __aexit__(self, *exc_info: object) -> None:
            self.exited += 1

        async def publish(
            self, destination: str, body: bytes, key: str | None = None, headers: Any = None
        ) -> None:
            assert asyncio.get_running_loop() is self.loop  # entered on the loop it runs on
            await asyncio.sleep(0)
            self.broker.publish(destination, body, key, headers)

    add_events(db, [("a", "k"), ("b", "k"), ("c", None)])
    publisher = AsyncMemoryPublisher()
    with OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK) as relay:
        assert relay.drain() == 3
    assert [m.body for m in publisher.broker.messages("orders")] == [b"a", b"b", b"c"]
    assert (publisher.entered, publisher.exited) == (1, 1)


def test_a_blocking_publisher_is_entered_before_its_first_publish_and_left_at_close(
    db: Any,
) -> None:
    class Counting(Publisher):
        def __init__(self) -> None:
            self.broker = MemoryBroker()
            self.entered = self.exited = 0

        def __enter__(self) -> Counting:
            self.entered += 1
            return self

        def __exit__(self, *exc_info: object) -> None:
            self.exited += 1

        def publish(
            self, destination: str, body: bytes, key: str | None = None, headers: Any = None
        ) -> None:
            assert (self.entered, self.exited) == (1, 0)
            self.broker.publish(destination, body, key, headers)

    publisher = Counting()
    with OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK) as relay:
        assert relay.drain() == 0
        assert publisher.entered == 0  # nothing to publish: nothing opened
        add_events(db, [("a", "k"), ("b", "k")])
        assert relay.drain() == 2
    assert (publisher.entered, publisher.exited) == (1, 1)


def test_an_object_with_only_publish_still_works_with_a_deprecation_warning(db: Any) -> None:
    class OnlyPublish:  # what the first Publisher protocol asked for
        def __init__(self) -> None:
            self.broker = MemoryBroker()

        def publish(
            self, destination: str, body: bytes, key: str | None = None, headers: Any = None
        ) -> None:
            self.broker.publish(destination, body, key, headers)

    add_events(db, [("a", "k")])
    publisher = OnlyPublish()
    with pytest.warns(DeprecationWarning, match="subclass consumerdedup.Publisher"):
        relay = OutboxRelay(db.engine, publisher, tables=db.tables, config=QUICK)
    with relay:
        assert relay.drain() == 1
    assert [m.body for m in publisher.broker.messages("orders")] == [b"a"]


def test_a_key_lock_bucket_row_missing_on_mariadb_fails_closed_and_install_restores_it(
    mariadb: Any,
) -> None:
    """Outbox.add with a key whose bucket row is gone would lock nothing (same-key producers
    could commit out of order): refused, naming the fix; install() puts the rows back."""
    from consumerdedup import install
    from consumerdedup.outbox.mysql import bucket_of
    from consumerdedup.schema.mysql_outbox import key_locks_table

    locks = key_locks_table(mariadb.tables.outbox)
    with mariadb.engine.begin() as conn:
        conn.execute(locks.delete().where(locks.c.bucket == bucket_of("k")))
    with pytest.raises(ConfigurationError, match="install"), Session(mariadb.engine) as session:
        Outbox(mariadb.tables).add(session, "orders", b"x", key="k")
    assert outbox_rows(mariadb) == []
    add_events(mariadb, [("other", "k2" if bucket_of("k2") != bucket_of("k") else "k3")])
    install(mariadb.engine, mariadb.tables)
    add_events(mariadb, [("again", "k")])
    assert [r.body for r in outbox_rows(mariadb)] == [b"other", b"again"]
