"""Round 11 attacks on the outbox relay on MySQL/MariaDB: per-key order against row locks
held by the application (not a relay), a relay's key-lock rows, and rollbacks.

The relay claims with ``SELECT ... FOR UPDATE SKIP LOCKED`` by primary key; a row the
application holds is skipped. The promise: a key's later events never go before an
earlier one that did not come back locked, and other keys are not held up.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, OutboxRelay, Outcome, RelayConfig
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

NOW = RelayConfig(batch_size=10, initial_backoff=timedelta(0), max_backoff=timedelta(0))


def add(db: Database, events: Sequence[tuple[str, str | None]]) -> list[str]:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        return [outbox.add(session, "q", b.encode(), key=k) for b, k in events]


def bodies(broker: MemoryBroker) -> list[str]:
    return list(dict.fromkeys(m.body.decode() for m in broker.messages("q")))


LOCKS = {
    "select-for-update": "SELECT 1 FROM {t} WHERE id = :id FOR UPDATE",
    "select-lock-in-share-mode": "SELECT 1 FROM {t} WHERE id = :id LOCK IN SHARE MODE",
    "update-a-column": "UPDATE {t} SET last_error = 'looked at by support' WHERE id = :id",
    "foreign-key-reference": (
        "INSERT INTO {t}_refs (event_id) SELECT event_id FROM {t} WHERE id = :id"
    ),
}


@pytest.mark.parametrize("batch_size", [10, 2])
@pytest.mark.parametrize("how", sorted(LOCKS))
def test_a_row_lock_on_a_keys_oldest_event_does_not_let_its_later_events_overtake(
    mariadb: Database, how: str, batch_size: int
) -> None:
    add(mariadb, [("k0", "K"), ("k1", "K"), ("k2", "K"), ("o0", "O")])
    outbox = mariadb.name("outbox")
    oldest = mariadb.scalar(f"SELECT min(id) FROM {outbox} WHERE `key` = 'K'")
    with mariadb.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {outbox}_refs (event_id VARCHAR(64), "
                f"FOREIGN KEY (event_id) REFERENCES {outbox} (event_id))"
            )
        )
    broker = MemoryBroker()
    config = RelayConfig(
        batch_size=batch_size, initial_backoff=timedelta(0), max_backoff=timedelta(0)
    )
    relay = OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=config)
    with mariadb.engine.connect() as app:
        tx = app.begin()
        app.execute(text(LOCKS[how].format(t=outbox)), {"id": oldest})
        relay.run_once()  # the application's transaction is still open
        during = bodies(broker)
        tx.rollback()
    assert [b for b in during if b.startswith("k")] == []
    relay.drain()
    seen = bodies(broker)
    assert "o0" in seen
    assert [b for b in seen if b.startswith("k")] == ["k0", "k1", "k2"]


def test_a_producer_holding_a_keys_bucket_holds_back_nothing_it_did_not_write(
    mariadb: Database,
) -> None:
    """A producer's open transaction adds k1 (its bucket row locked until it ends); k0,
    committed before, is published meanwhile, and k1 after it commits, in order."""
    add(mariadb, [("k0", "K")])
    broker = MemoryBroker()
    relay = OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=NOW)
    outbox = Outbox(mariadb.tables)
    with Session(mariadb.engine) as session:
        session.begin()
        outbox.add(session, "q", b"k1", key="K")
        relay.run_once()
        assert bodies(broker) == ["k0"]
        session.commit()
    relay.drain()
    assert bodies(broker) == ["k0", "k1"]


def test_a_handler_whose_outbox_events_are_rolled_back_publishes_nothing(
    mariadb: Database,
) -> None:
    """A handler adds an event with a key, then swallows a deadlock-free statement error
    and raises: the message FAILED, its event never published; a second handler's
    event of the same key (same bucket) goes alone."""
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables)
    outbox = Outbox(mariadb.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "q", message.id.encode(), key="K")
        if message.id == "bad":
            raise ValueError("refused")

    assert handle(Message(id="bad", body=b"x")) is Outcome.FAILED
    assert handle(Message(id="good", body=b"x")) is Outcome.PROCESSED
    broker = MemoryBroker()
    OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=NOW).drain()
    assert bodies(broker) == ["good"]


def test_two_relays_racing_one_key_publish_it_in_order(mariadb: Database) -> None:
    """Two relays run rounds at once (a barrier starts them together) over 60 events of 3
    keys: each key's events go in the order they were added, none twice in a row
    from different relays' interleaving."""
    events = [(f"{k}{i:02d}", k) for i in range(20) for k in "ABC"]
    add(mariadb, events)
    broker = MemoryBroker()
    config = RelayConfig(batch_size=4, initial_backoff=timedelta(0), max_backoff=timedelta(0))
    relays = [
        OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=config) for _ in range(2)
    ]
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(relay: OutboxRelay) -> None:
        try:
            barrier.wait(10)
            relay.drain()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in relays]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    seen = [m.body.decode() for m in broker.messages("q")]
    for key in "ABC":
        mine = [b for b in seen if b.startswith(key)]
        assert mine == sorted(mine)  # in order, and no copy after a later event
        assert sorted(set(mine)) == [f"{key}{i:02d}" for i in range(20)]


class RefuseFirst(MemoryBroker):
    """Refuses ``body`` (every time), publishes the rest."""

    def __init__(self, body: bytes) -> None:
        super().__init__()
        self.refused = body

    def publish(
        self, destination: str, body: bytes, key: Any = None, headers: Any = None, **kw: Any
    ) -> None:
        if body == self.refused:
            raise ValueError("refused")
        super().publish(destination, body, key, headers, **kw)


@pytest.mark.parametrize("other", ["k", "K ", "\u212a"], ids=["case", "trailing-space", "kelvin"])
def test_a_backing_off_key_holds_back_only_itself_not_its_lookalikes(
    mariadb: Database, other: str
) -> None:
    """K's first event fails and backs off for an hour, holding back K's later events; a key
    that differs from K only by case, a trailing space or a Unicode folding (the outbox's
    key column has the server's default collation) is another key, and goes."""
    add(mariadb, [("K0", "K"), ("K1", "K"), ("o0", other), ("o1", other)])
    broker = RefuseFirst(b"K0")
    later = RelayConfig(
        batch_size=10, initial_backoff=timedelta(hours=1), max_backoff=timedelta(hours=1)
    )
    relay = OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=later)
    relay.run_once()
    relay.run_once()
    assert bodies(broker) == ["o0", "o1"]


@pytest.mark.parametrize("other", ["k", "K ", "\u212a"], ids=["case", "trailing-space", "kelvin"])
def test_a_row_lock_on_a_key_holds_back_only_itself_not_its_lookalikes(
    mariadb: Database, other: str
) -> None:
    add(mariadb, [("K0", "K"), ("o0", other), ("K1", "K"), ("o1", other)])
    outbox = mariadb.name("outbox")
    oldest = mariadb.scalar(f"SELECT min(id) FROM {outbox}")
    broker = MemoryBroker()
    relay = OutboxRelay(mariadb.engine, broker, tables=mariadb.tables, config=NOW)
    with mariadb.engine.connect() as app, app.begin():
        app.execute(text(f"SELECT 1 FROM {outbox} WHERE id = :id FOR UPDATE"), {"id": oldest})
        relay.run_once()
        assert bodies(broker) == ["o0", "o1"]
    relay.drain()
    assert bodies(broker) == ["o0", "o1", "K0", "K1"]
