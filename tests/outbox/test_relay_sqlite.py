"""On SQLite the relay never waits on the broker while it holds the database's write lock.

SQLite has one write lock for the whole file: a relay that published inside
its write transaction made every consumer wait as long as the broker did (a
connect timeout, say). The round now reads its rows, publishes, and only then
marks them in a short write transaction; at least once and per-key order hold.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import (
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    Publisher,
    SimulatedCrash,
    Tables,
    install,
)
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from consumerdedup.testing import MemoryBroker

BOUND = 10.0
"""Seconds the consumer may take for its messages while the relay is stuck: a hang guard
half the consumer's busy timeout (20 s), so a relay holding SQLite's write lock while it
waits (it waits for the whole run, checked) still fails the test, whatever the load. It
was 2 s, a throughput bound (20 SQLite commits) that a loaded machine's disk could break."""


class Files:
    def __init__(self, path: Path) -> None:
        self.url = f"sqlite:///{path}"
        self.tables = Tables.define()
        self.relay_engine = self.engine()
        with self.relay_engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        install(self.relay_engine, self.tables)
        with self.relay_engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE ledger (message_id TEXT)")
        self.consumer_engine = self.engine()
        self.outbox = Outbox(self.tables)

    def engine(self) -> Engine:
        # A busy timeout longer than BOUND: waiting on the relay's lock shows as slowness.
        return create_engine(self.url, connect_args={"timeout": 20})

    def add_events(self, *keys: str | None) -> None:
        with Session(self.relay_engine) as session, session.begin():
            for n, key in enumerate(keys):
                self.outbox.add(session, "events", f"{n}".encode(), key=key)

    def consumer(self) -> Any:
        dedup = Deduplicator(self.consumer_engine, "ledger", tables=self.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            session.execute(text("INSERT INTO ledger VALUES (:m)"), {"m": message.id})
            self.outbox.add(session, "events", message.body, key=message.id)

        return handle

    def close(self) -> None:
        self.relay_engine.dispose()
        self.consumer_engine.dispose()


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Files]:
    made = Files(tmp_path / "app.db")
    yield made
    made.close()


class StuckPublisher(Publisher):
    """A broker that hangs until released, then turns out to be away."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.release = threading.Event()

    def publish(
        self, destination: str, body: bytes, key: str | None, headers: Mapping[str, str]
    ) -> None:
        self.waiting.set()
        self.release.wait(30)
        raise ConnectionError("broker did not answer")


def consume_while(files: Files, busy: threading.Thread, count: int = 20) -> float:
    """Process ``count`` new messages; returns the seconds they took. ``busy`` must outlast it."""
    handle = files.consumer()
    started = time.monotonic()
    outcomes = [handle(Message(f"m-{i}", b"{}")) for i in range(count)]
    took = time.monotonic() - started
    assert busy.is_alive(), "the relay was not stuck for the whole run: nothing was tested"
    assert outcomes == [Outcome.PROCESSED] * count
    return took


def test_consumers_keep_going_while_the_relay_waits_on_the_broker(files: Files) -> None:
    files.add_events("k-1", "k-2")
    stuck = StuckPublisher()
    relay = OutboxRelay(files.relay_engine, stuck, tables=files.tables)
    round_ = threading.Thread(target=relay.run_once)
    round_.start()
    try:
        assert stuck.waiting.wait(10)
        took = consume_while(files, round_)
    finally:
        stuck.release.set()
        round_.join(30)
    assert took < BOUND, f"20 messages took {took:.1f}s while the relay waited on the broker"
    # The broker was away: no attempt charged, everything still goes, each key in order.
    broker = MemoryBroker()
    assert OutboxRelay(files.relay_engine, broker, tables=files.tables).drain() == 22
    bodies = [m.body for m in broker.messages("events")]
    assert bodies[:2] == [b"0", b"1"] and len(bodies) == 22


def test_consumers_keep_going_while_a_rabbit_publisher_cannot_connect(
    files: Files, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as probe:  # a local port where nothing answers
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    publisher = RabbitPublisher(
        f"amqp://guest:guest@127.0.0.1:{port}/%2F", connect_timeout=timedelta(seconds=3)
    )
    files.add_events("k-1")
    relay = OutboxRelay(files.relay_engine, publisher, tables=files.tables)
    round_ = threading.Thread(target=relay.run_once)
    round_.start()
    try:
        deadline = time.monotonic() + 10
        # The publisher logs each failed connection attempt before it tries again.
        while not any("connection attempt" in r.getMessage() for r in list(caplog.records)):
            assert round_.is_alive(), "the relay's round ended before it retried a connection"
            assert time.monotonic() < deadline, "the relay never tried to connect"
            time.sleep(0.02)
        took = consume_while(files, round_, count=10)  # the relay is retrying meanwhile
    finally:
        round_.join(30)
    assert took < BOUND, f"10 messages took {took:.1f}s while the relay tried to connect"
    assert relay.backlog() == 11 and relay.parked() == []


class CrashAfter(Publisher):
    """Publishes to a MemoryBroker, then dies right after the ``n``-th confirmation."""

    def __init__(self, broker: MemoryBroker, n: int) -> None:
        self.broker = broker
        self.left = n

    def publish(
        self, destination: str, body: bytes, key: str | None, headers: Mapping[str, str]
    ) -> None:
        self.broker.publish(destination, body, key, headers)
        self.left -= 1
        if self.left == 0:
            raise SimulatedCrash("relay killed after a broker confirmation")


def test_a_relay_killed_between_publish_and_mark_publishes_again_in_order(files: Files) -> None:
    files.add_events("a", "b", "a", "b")
    broker = MemoryBroker()
    with pytest.raises(SimulatedCrash):
        OutboxRelay(files.relay_engine, CrashAfter(broker, 3), tables=files.tables).run_once()
    assert OutboxRelay(files.relay_engine, broker, tables=files.tables).drain() == 4
    sent = [(m.headers["event_id"], m.body) for m in broker.messages("events")]
    assert [body for _, body in sent] == [b"0", b"1", b"2", b"0", b"1", b"2", b"3"]
    assert len({event_id for event_id, _ in sent}) == 4  # the repeats carry the same event_id


class RefuseFirst(Publisher):
    """Refuses the first publish of key ``a`` (not a broker outage): that key is held back."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.refused = False

    def publish(
        self, destination: str, body: bytes, key: str | None, headers: Mapping[str, str]
    ) -> None:
        if key == "a" and not self.refused:
            self.refused = True
            raise ValueError("refused")
        self.broker.publish(destination, body, key, headers)


def test_a_failed_row_holds_back_its_key_and_is_charged_an_attempt(files: Files) -> None:
    files.add_events("a", "b", "a")
    broker = MemoryBroker()
    relay = OutboxRelay(files.relay_engine, RefuseFirst(broker), tables=files.tables)
    assert relay.run_once() == 1  # b only: a's second row waits behind its first
    with files.relay_engine.connect() as conn:
        attempts = conn.exec_driver_sql("SELECT key, attempts FROM outbox ORDER BY id").all()
    assert [tuple(r) for r in attempts] == [("a", 1), ("b", 0), ("a", 0)]
    time.sleep(0.25)  # the first backoff
    assert relay.drain() == 2
    assert [m.body for m in broker.messages("events")] == [b"1", b"0", b"2"]
