"""README promises of the RabbitMQ runner that no other test holds it to.

- "a clean batch is acked with one ``multiple=True`` ack after the commit": every
  ``basic_ack`` the runner sends is recorded at pika's BlockingChannel, next to the
  batches the handler was given;
- ``declare=True`` points the queue's broker-side dead-lettering at the runner's DLQ, "so
  broker-side dead-lettering from TTL, max-length or a quorum queue's delivery limit
  lands there too": each is made to happen for real.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import pytest
from pika.adapters.blocking_connection import BlockingChannel
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, Outcome, Result, RetryLater, RetryPolicy
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

QUICK = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"idle_timeout": timedelta(milliseconds=300), "retry_delay": timedelta(0)}


class Consumer:
    """A runner whose handler writes one ledger row per message, or asks for a retry."""

    def __init__(self, db: Database, rabbit: Broker, queue: str, **config: Any) -> None:
        self.db = db
        self.ledger = db.create_ledger()
        self.seen: list[str] = []
        self.batches: list[list[str]] = []
        dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables, retry=QUICK)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            self.seen.append(str(message.id))
            if message.json().get("retry"):
                raise RetryLater("not now")
            session.execute(
                text(
                    f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('a', 1, :m)"
                ),
                {"m": message.id},
            )

        # The runner hands each batch to process_deliveries (1424888): record what it gets.
        process_deliveries = handle.process_deliveries

        def recorded(delivered: Sequence[Any], **options: Any) -> list[Result]:
            ids = [str((d[0] if isinstance(d, tuple) else d).id) for d in delivered]
            self.batches.append(ids)
            return process_deliveries(delivered, **options)

        handle.process_deliveries = recorded  # type: ignore[method-assign]
        self.runner = RabbitConsumerRunner(
            handle, queue, url=rabbit.url, config=RabbitConfig(**{**FAST, **config})
        )

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {self.ledger}")]

    def recorded(self) -> int:
        return int(str(self.db.scalar(f"SELECT count(*) FROM {self.db.name('processed_events')}")))


def body(**data: Any) -> bytes:
    return json.dumps(data).encode()


@pytest.fixture
def acks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """Every ack and nack sent on any pika BlockingChannel: (kind, delivery tag, multiple)."""
    sent: list[tuple[str, int, bool]] = []
    ack, nack = BlockingChannel.basic_ack, BlockingChannel.basic_nack

    def basic_ack(self: Any, delivery_tag: int = 0, multiple: bool = False) -> Any:
        sent.append(("ack", delivery_tag, multiple))
        return ack(self, delivery_tag, multiple)

    def basic_nack(
        self: Any, delivery_tag: int = 0, multiple: bool = False, requeue: bool = True
    ) -> Any:
        sent.append(("nack", delivery_tag, multiple))
        return nack(self, delivery_tag, multiple, requeue)

    monkeypatch.setattr(BlockingChannel, "basic_ack", basic_ack)
    monkeypatch.setattr(BlockingChannel, "basic_nack", basic_nack)
    return sent


# --- one ack per clean batch -------------------------------------------------------------------


def test_a_clean_batch_is_acked_with_one_multiple_ack(
    db: Database, rabbit: Broker, acks: list[tuple[str, int, bool]]
) -> None:
    queue = rabbit.queue()
    ids = [f"m-{i:02d}" for i in range(12)] + ["m-03", "m-07"]  # two redeliveries: DUPLICATE
    for mid in ids:
        rabbit.publish(queue, body(n=1), mid)
    consumer = Consumer(db, rabbit, queue, batch_size=5, prefetch=20)
    consumer.runner.run(until_idle=True)

    assert consumer.runner.outcomes == {Outcome.PROCESSED: 12, Outcome.DUPLICATE: 2}
    assert [mid for batch in consumer.batches for mid in batch] == ids
    assert max(len(batch) for batch in consumer.batches) > 1, consumer.batches
    # One ack per batch, after it: the last delivery tag of the batch, multiple if it had more.
    expected, tag = [], 0
    for batch in consumer.batches:
        tag += len(batch)
        expected.append(("ack", tag, len(batch) > 1))
    assert acks == expected
    assert sorted(consumer.applied()) == sorted(set(ids))
    assert rabbit.held(queue) == 0


def test_a_batch_with_a_retry_acks_the_others_one_by_one(
    db: Database, rabbit: Broker, acks: list[tuple[str, int, bool]]
) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(retry=True), "m-2")
    rabbit.publish(queue, body(n=1), "m-3")
    consumer = Consumer(
        db, rabbit, queue, batch_size=3, prefetch=3, retry_delay=timedelta(milliseconds=200)
    )
    thread = threading.Thread(target=consumer.runner.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not any(kind == "nack" for kind, _, _ in acks) and time.monotonic() < deadline:
        time.sleep(0.02)
    consumer.runner.stop()  # m-2 would come back forever
    thread.join(30)
    assert not thread.is_alive()
    assert consumer.batches[0] == ["m-1", "m-2", "m-3"]
    assert acks[:3] == [("ack", 1, False), ("ack", 3, False), ("nack", 2, False)]
    assert sorted(consumer.applied()) == ["m-1", "m-3"]


# --- broker-side dead-lettering lands in the runner's DLQ --------------------------------------


def x_death(rabbit: Broker, dlq: str, timeout: float = 15) -> list[tuple[str | None, str]]:
    """(message_id, x-death reason) of each message of ``dlq``, once it has any."""
    deadline = time.monotonic() + timeout
    while rabbit.ready(dlq) == 0:
        assert time.monotonic() < deadline, f"nothing reached {dlq}"
        time.sleep(0.05)
    return [
        (props.message_id, props.headers["x-death"][0]["reason"]) for props, _ in rabbit.peek(dlq)
    ]


def declared(db: Database, rabbit: Broker, prefix: str, **arguments: Any) -> Consumer:
    queue = rabbit.name(prefix)
    consumer = Consumer(db, rabbit, queue, declare=True, queue_arguments=arguments)
    consumer.runner.declare()
    return consumer


def test_a_message_past_its_ttl_is_dead_lettered_by_the_broker_into_the_dlq(
    db: Database, rabbit: Broker
) -> None:
    consumer = declared(db, rabbit, "ttl", **{"x-message-ttl": 100})
    queue = consumer.runner.queue
    rabbit.publish(queue, body(n=1), "m-1")
    assert x_death(rabbit, queue + ".dlq") == [("m-1", "expired")]
    consumer.runner.run(until_idle=True)
    assert consumer.seen == [] and consumer.applied() == []
    assert rabbit.held(queue) == 0


def test_a_message_pushed_out_by_max_length_is_dead_lettered_into_the_dlq(
    db: Database, rabbit: Broker
) -> None:
    consumer = declared(db, rabbit, "maxlen", **{"x-max-length": 2})
    queue = consumer.runner.queue
    for i in (1, 2, 3):
        rabbit.publish(queue, body(n=i), f"m-{i}")
    assert x_death(rabbit, queue + ".dlq") == [("m-1", "maxlen")]
    consumer.runner.run(until_idle=True)
    assert sorted(consumer.applied()) == ["m-2", "m-3"]
    assert rabbit.held(queue) == 0


def test_a_quorum_queues_delivery_limit_dead_letters_a_message_retried_too_often(
    db: Database, rabbit: Broker
) -> None:
    consumer = declared(db, rabbit, "limit", **{"x-queue-type": "quorum", "x-delivery-limit": 2})
    queue = consumer.runner.queue
    rabbit.publish(queue, body(retry=True), "m-1")
    rabbit.publish(queue, body(n=2), "m-2")
    consumer.runner.run(until_idle=True)  # m-1 is nacked back until the broker gives up on it
    assert x_death(rabbit, queue + ".dlq") == [("m-1", "delivery_limit")]
    assert 2 <= consumer.seen.count("m-1") <= 4, consumer.seen
    assert consumer.applied() == ["m-2"]
    assert consumer.recorded() == 1  # RETRY records nothing; the broker's drop neither
    assert consumer.runner.outcomes[Outcome.RETRY] == consumer.seen.count("m-1")
    assert rabbit.held(queue) == 0
