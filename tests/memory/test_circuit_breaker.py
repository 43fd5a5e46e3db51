"""A broken deploy stops the runner instead of dead-lettering the stream (issue 38 item 6).

Before: a handler raising KeyError on every message had each one retried, FAILED
and dead-lettered, the whole queue in turn. Now the runner's circuit breaker
opens after ``breaker_threshold`` messages in a row FAILED with one exception
type: run() ends with CircuitOpen, the messages not taken stay in the queue,
and after the fix a new runner plus a replay of the dead letters applies every
message exactly once.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, RetryPolicy
from consumerdedup.errors import CircuitOpen
from consumerdedup.failed.records import forget
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database

FAST = timedelta(0)


class Shop:
    """A consumer whose handler reads ``field`` of each order: "sku" is the broken deploy."""

    def __init__(self, db: Database, threshold: int | None = 3) -> None:
        self.db = db
        self.ledger = db.create_ledger()
        self.field = "sku"
        retry = RetryPolicy(
            attempts=2, initial_delay=FAST, max_delay=FAST, breaker_threshold=threshold
        )
        self.dedup = Deduplicator(db.engine, "shop", tables=db.tables, retry=retry)

        @self.dedup.handler
        def handle(message: Message, session: Any) -> None:
            order = message.json()
            session.execute(
                text(f"INSERT INTO {self.ledger} VALUES (:a, :n, :m)"),
                {"a": order[self.field], "n": order["amount"], "m": message.id},
            )

        self.handle = handle

    def runner(self, broker: MemoryBroker, batch_size: int) -> MemoryConsumerRunner:
        config = MemoryConfig(batch_size=batch_size, retry_delay=FAST, max_retry_delay=FAST)
        return MemoryConsumerRunner(self.handle, "orders", broker=broker, config=config)

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {self.ledger}")))

    def records(self) -> dict[str, str]:
        pe = self.db.tables.processed_events.fullname
        with self.db.engine.connect() as conn:
            rows = conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all()
        return {row[0]: row[1] for row in rows}


IDS = [f"order-{n:02d}" for n in range(20)]


def publish(broker: MemoryBroker) -> None:
    for n, message_id in enumerate(IDS):
        broker.publish("orders", b'{"item": "book", "amount": %d}' % n, message_id=message_id)


def replay(shop: Shop, broker: MemoryBroker) -> int:
    """What ``consumerdedup failed replay`` does, on the memory broker: forget each dead
    letter's FAILED record, then publish it again to its queue."""
    letters = broker.fetch("orders.dlq", 100, consumer="replay", timeout=0)
    ids = [letter.message_id for letter in letters]
    forget(shop.db.engine, "shop", ids, tables=shop.db.tables)
    for letter in letters:
        broker.publish("orders", letter.body, message_id=letter.message_id)
        broker.ack(letter)
    return len(letters)


@pytest.mark.parametrize("batch_size", [100, 1], ids=["one-batch", "batch-of-one"])
def test_a_broken_deploy_stops_the_runner_and_a_fix_plus_replay_applies_all_once(
    sqlite_db: Database, batch_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="consumerdedup")
    broker, shop = MemoryBroker(), Shop(sqlite_db)
    publish(broker)
    runner = shop.runner(broker, batch_size)
    assert not runner.breaker.open
    with pytest.raises(CircuitOpen, match="3 messages in a row failed with KeyError"):
        runner.run(until_idle=True)
    # Three FAILED and dead-lettered; the seventeen others still the broker's, none acked.
    assert runner.breaker.open and not runner.ready and runner.stopping
    assert shop.records() == dict.fromkeys(IDS[:3], "failed")
    assert [m.id for m in broker.messages("orders.dlq")] == IDS[:3]
    assert broker.held("orders") == 17
    assert [m.id for m in broker.messages("orders")] == IDS[3:]  # in order, nothing lost
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "breaker" in r.msg]
    assert len(errors) == 1 and "KeyError" in errors[0].getMessage()

    shop.field = "item"  # the fix, deployed: a new runner, a closed breaker
    shop.runner(broker, batch_size).run(until_idle=True)
    assert shop.applied() == IDS[3:]
    assert replay(shop, broker) == 3
    shop.runner(broker, batch_size).run(until_idle=True)
    assert shop.applied() == IDS  # each exactly once
    assert shop.records() == dict.fromkeys(IDS, "processed")
    assert broker.held("orders") == 0 and broker.held("orders.dlq") == 0


def test_a_stream_with_some_bad_messages_never_trips(sqlite_db: Database) -> None:
    """Bad data here and there (two in a row at most) is dead-lettered as before."""
    broker, shop = MemoryBroker(), Shop(sqlite_db)
    for n, message_id in enumerate(IDS):
        body = b'{"sku": "x", "amount": 1}' if n % 3 else b'{"item": "x", "sku": "x", "amount": 1}'
        broker.publish("orders", body, message_id=message_id)
    shop.field = "item"
    runner = shop.runner(broker, 100)
    runner.run(until_idle=True)
    assert not runner.breaker.open
    assert len(broker.messages("orders.dlq")) == 13 and broker.held("orders") == 0


def test_the_breaker_can_be_turned_off(sqlite_db: Database) -> None:
    broker, shop = MemoryBroker(), Shop(sqlite_db, threshold=None)
    publish(broker)
    runner = shop.runner(broker, 100)
    runner.run(until_idle=True)  # the old behaviour, asked for: all dead-lettered
    assert not runner.breaker.open
    assert len(broker.messages("orders.dlq")) == 20 and broker.held("orders") == 0
