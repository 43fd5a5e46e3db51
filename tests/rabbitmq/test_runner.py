"""RabbitConsumerRunner on the real broker: ids, dead letters, retries, topology, stopping."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pika
import pytest
from sqlalchemy import text

from consumerdedup import (
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.adapters.rabbitmq import (
    SOURCE_HEADER,
    BrokerRefused,
    BrokerUnavailable,
    DeadLetterMissing,
    RabbitConfig,
    RabbitConsumerRunner,
    TopologyError,
)
from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER
from tests.core.test_lifecycle import MARGIN, NOTICED
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

QUICK = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"idle_timeout": timedelta(milliseconds=300), "retry_delay": timedelta(0)}


class Consumer:
    """A runner over ``db`` whose handler records each message and may refuse some."""

    def __init__(
        self, db: Any, rabbit: Broker, queue: str, ledger: str | None = None, **config: Any
    ) -> None:
        self.seen: list[Message] = []
        self.ledger = ledger or db.create_ledger()
        dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables, retry=QUICK)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            self.seen.append(message)
            data = message.json()
            if data.get("refuse"):
                raise PermanentError(data["refuse"])
            if len([m for m in self.seen if m.id == message.id]) <= data.get("retries", 0):
                raise RetryLater("not yet")
            session.execute(
                text(
                    f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('a', 1, :m)"
                ),
                {"m": message.id},
            )

        self.db = db
        self.runner = RabbitConsumerRunner(
            handle, queue, url=rabbit.url, config=RabbitConfig(**{**FAST, **config})
        )

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return [r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {self.ledger}")]

    def start(self) -> Callable[[], None]:
        thread = threading.Thread(target=self.runner.run, daemon=True)
        thread.start()

        def stop() -> None:
            self.runner.stop()
            thread.join(30)
            assert not thread.is_alive()

        return stop


def body(**data: Any) -> bytes:
    return json.dumps(data).encode()


def dead_letters(rabbit: Broker, queue: str) -> list[tuple[Any, bytes]]:
    return rabbit.peek(queue + ".dlq")


def test_the_id_is_the_message_id_property_then_the_header_then_the_key_function(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    stamp = 1_700_000_000
    rabbit.publish(
        queue, body(n=1), "from-property", headers={"event_id": "ignored"}, timestamp=stamp
    )
    rabbit.publish(
        queue, body(n=2), headers={"event_id": "from-header", "tries": 3}, timestamp=2**62
    )
    rabbit.publish(queue, body(n=3, id="from-body"))
    rabbit.publish(queue, body(n=4), headers={"my_id": "from-custom-header"})
    consumer = Consumer(db, rabbit, queue, key=lambda message: message.json().get("id"))
    consumer.runner.run(until_idle=True)
    other = Consumer(db, rabbit, queue, consumer.ledger, id_header="my_id")
    rabbit.publish(queue, body(n=4), headers={"my_id": "from-custom-header"})
    other.runner.run(until_idle=True)

    assert [m.id for m in consumer.seen] == ["from-property", "from-header", "from-body"]
    assert [m.id for m in other.seen] == ["from-custom-header"]
    first, second = consumer.seen[:2]
    assert first.timestamp == datetime.fromtimestamp(stamp, UTC)
    assert second.timestamp is None  # out of range: dropped, not fatal
    assert second.headers == {"event_id": "from-header", "tries": "3"}  # header values as text
    assert second.source == queue and second.raw.method.redelivered is False
    [(props, _)] = dead_letters(rabbit, queue)  # message 4 had no id for the first consumer
    assert "InvalidMessage: no message id" in props.headers[REASON_HEADER]
    assert "the key function found none" in props.headers[REASON_HEADER]
    assert rabbit.held(queue) == 0


def test_malformed_deliveries_are_dead_lettered_with_their_reason_and_consumption_goes_on(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1))  # no id at all
    rabbit.publish(queue, body(n=2), headers={"event_id": "x" * 300})  # oversized id
    rabbit.publish(queue, body(n=3), headers={"event_id": 42})  # not text
    rabbit.publish(queue, b"\xff\xfe not json", "bad-body")
    rabbit.publish(queue, body(n=5), "m-5")
    rabbit.publish(queue, body(n=6, id=None), headers={"kind": "needs-key"})
    consumer = Consumer(db, rabbit, queue, key=lambda message: message.json()["id"]["oops"])
    consumer.runner.run(until_idle=True)

    assert consumer.applied() == ["m-5"]
    reasons = [props.headers[REASON_HEADER] for props, _ in dead_letters(rabbit, queue)]
    assert len(reasons) == 5
    assert "no message id" in reasons[0] and "the key function raised KeyError" in reasons[0]
    assert "300 characters long, the limit is 255" in reasons[1]
    assert "must be a str, got int" in reasons[2]
    assert reasons[3].startswith("DecodeError")
    assert "the key function raised TypeError" in reasons[4]
    assert rabbit.held(queue) == 0


def test_a_dead_letter_keeps_the_message_and_adds_why_who_and_where(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    payload = body(refuse="no such account")
    rabbit.publish(
        queue,
        payload,
        "m-1",
        headers={"trace": "t-1"},
        content_type="application/json",
        expiration="60000",
    )
    rabbit.publish(queue, body(n=2), "m-2")
    consumer = Consumer(db, rabbit, queue, batch_size=5)
    consumer.runner.run(until_idle=True)

    [(props, dead_body)] = dead_letters(rabbit, queue)
    assert dead_body == payload and props.message_id == "m-1"
    assert props.content_type == "application/json" and props.delivery_mode == 2
    assert props.expiration is None  # the original's TTL must not expire the dead letter
    assert props.headers["trace"] == "t-1"
    assert props.headers[REASON_HEADER] == "PermanentError: no such account"
    assert props.headers[CONSUMER_HEADER] == "ledger"
    assert props.headers[SOURCE_HEADER] == queue
    assert consumer.applied() == ["m-2"]
    assert consumer.runner.outcomes[Outcome.FAILED] == 1

    # A redelivery of the refused message is dead-lettered again with the first reason.
    rabbit.publish(queue, payload, "m-1")
    Consumer(db, rabbit, queue, consumer.ledger).runner.run(until_idle=True)
    reasons = [props.headers[REASON_HEADER] for props, _ in dead_letters(rabbit, queue)]
    assert reasons[1].startswith("RecordedFailure") and "no such account" in reasons[1]


def test_declare_creates_the_queue_a_dead_letter_exchange_and_its_queue(
    db: Any, rabbit: Broker
) -> None:
    queue, exchange = rabbit.name("declared"), rabbit.name("dlx")
    consumer = Consumer(db, rabbit, queue, declare=True, dead_letter_exchange=exchange)
    consumer.runner.run(until_idle=True)  # declares everything, finds nothing to do
    rabbit.publish(queue, body(refuse="bad"), "m-1")
    consumer.runner.run(until_idle=True)  # and declaring again is harmless

    [(props, _)] = dead_letters(rabbit, queue)
    assert props.headers[REASON_HEADER] == "PermanentError: bad"
    assert rabbit.held(queue) == 0


def test_without_a_dead_letter_queue_the_runner_stops_and_the_message_stays_until_there_is_one(
    db: Any, rabbit: Broker
) -> None:
    """No queue takes the dead letter: a setup fault, not "not there yet" (issue 38, item 5;
    bounded and with the old behaviour's failure: tests/rabbitmq/test_dead_letter_missing.py)."""
    queue = rabbit.queue(dead_letter=False)
    rabbit.publish(queue, body(refuse="bad"), "m-1")
    rabbit.publish(queue, body(n=2), "m-2")
    consumer = Consumer(db, rabbit, queue, retry_delay=timedelta(milliseconds=100), batch_size=1)
    with pytest.raises(DeadLetterMissing, match="declare the dead-letter queue"):
        consumer.runner.run(until_idle=True)
    assert consumer.applied() == []
    assert rabbit.held(queue) == 2  # the refused message was not acked: nothing lost

    rabbit.channel.queue_declare(queue + ".dlq", durable=True)
    Consumer(db, rabbit, queue, consumer.ledger).runner.run(until_idle=True)
    [(props, _)] = dead_letters(rabbit, queue)
    assert props.message_id == "m-1" and "bad" in props.headers[REASON_HEADER]
    assert consumer.applied() == ["m-2"]
    assert rabbit.held(queue) == 0


def test_retry_is_given_back_after_a_backoff_that_doubles(db: Any, rabbit: Broker) -> None:
    queue = rabbit.queue()
    rabbit.publish(queue, body(retries=3), "m-1")
    consumer = Consumer(db, rabbit, queue, retry_delay=timedelta(milliseconds=200))
    started = time.monotonic()
    consumer.runner.run(until_idle=True)
    elapsed = time.monotonic() - started

    assert elapsed >= 0.2 + 0.4 + 0.8
    assert [m.raw.method.redelivered for m in consumer.seen] == [False, True, True, True]
    assert consumer.applied() == ["m-1"]
    assert consumer.runner.outcomes == {Outcome.RETRY: 3, Outcome.PROCESSED: 1}
    assert rabbit.held(queue) == 0


def test_a_batch_with_a_retry_acks_the_others_and_gives_that_one_back(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    for i in range(10):
        rabbit.publish(queue, body(retries=1 if i == 4 else 0), f"m-{i}")
    consumer = Consumer(db, rabbit, queue, batch_size=10, prefetch=10)
    consumer.runner.run(until_idle=True)
    assert sorted(consumer.applied()) == [f"m-{i}" for i in range(10)]
    assert consumer.runner.outcomes == {Outcome.RETRY: 1, Outcome.PROCESSED: 10}
    assert rabbit.held(queue) == 0


def test_a_missing_queue_is_an_error_not_a_reconnect_loop(db: Any, rabbit: Broker) -> None:
    consumer = Consumer(db, rabbit, rabbit.name("missing"))
    with pytest.raises(TopologyError, match="NOT_FOUND"):
        consumer.runner.run()


def test_declaring_a_queue_that_exists_with_other_arguments_is_an_error(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue(dead_letter=False)
    consumer = Consumer(db, rabbit, queue, declare=True)
    with pytest.raises(TopologyError, match="PRECONDITION_FAILED"):
        consumer.runner.run()


def test_a_queue_deleted_while_consuming_stops_the_runner_with_an_error(
    db: Any, rabbit: Broker
) -> None:
    queue = rabbit.queue()
    consumer = Consumer(db, rabbit, queue)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            consumer.runner.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    rabbit.publish(queue, body(n=1), "m-1")
    deadline = time.monotonic() + 30
    while not consumer.applied() and time.monotonic() < deadline:
        time.sleep(0.05)
    rabbit.channel.queue_delete(queue)
    thread.join(30)
    assert not thread.is_alive()
    [error] = errors
    assert isinstance(error, TopologyError)


def test_stop_from_another_thread_ends_an_idle_runner_promptly(db: Any, rabbit: Broker) -> None:
    """Noticed within 0.1 s (the README), then the consumer is cancelled and the
    connection closed: run() has returned within that and a loaded machine's margin."""
    queue = rabbit.queue()
    consumer = Consumer(db, rabbit, queue)
    stop = consumer.start()
    try:
        deadline = time.monotonic() + 15
        while rabbit.channel.queue_declare(queue, passive=True).method.consumer_count == 0:
            assert time.monotonic() < deadline, "the runner never started consuming"
            time.sleep(0.02)
        # Consuming an empty queue: idle, waiting for a delivery.
    except BaseException:
        stop()
        raise
    started = time.monotonic()
    stop()
    took = time.monotonic() - started
    assert took < NOTICED + MARGIN, f"stop() of an idle runner took {took:.2f} s"


def test_an_unreachable_broker_is_reported_after_reconnect_timeout(db: Any) -> None:
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)
    handler = dedup.handler(lambda message, session: None)
    config = RabbitConfig(
        reconnect_delay=timedelta(milliseconds=50),
        max_reconnect_delay=timedelta(milliseconds=200),
        reconnect_timeout=timedelta(seconds=1),
    )
    runner = RabbitConsumerRunner(handler, "q", url="amqp://127.0.0.1:1/%2F", config=config)
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match="cannot connect"):
        runner.run()
    assert time.monotonic() - started < 10


def test_wrong_credentials_are_reported_at_once(db: Any, amqp_url: str) -> None:
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)
    handler = dedup.handler(lambda message, session: None)
    params = pika.URLParameters(amqp_url)
    url = f"amqp://nobody:wrong@{params.host}:{params.port}/%2F"
    # A setup fault (issue 17, item 10): a ConfigurationError, no longer a BrokerUnavailable,
    # which the outbox relay would take for an outage and retry forever.
    with pytest.raises(BrokerRefused, match="refused the credentials") as refused:
        RabbitConsumerRunner(handler, "q", url=url).run()
    assert isinstance(refused.value, ConfigurationError) and "wrong" not in str(refused.value)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"prefetch": 0}, "prefetch"),
        ({"prefetch": 10, "batch_size": 11}, "batch_size"),
        ({"id_header": ""}, "id_header"),
        ({"key": "event_id"}, "key"),
        ({"dead_letter_queue": ""}, "dead_letter_queue"),
        ({"retry_delay": timedelta(seconds=-1)}, "retry_delay"),
        ({"retry_delay": timedelta(seconds=60)}, "max_retry_delay"),
        ({"reconnect_timeout": timedelta(0)}, "reconnect_timeout"),
    ],
)
def test_bad_config_is_refused_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RabbitConfig(**options)


def test_bad_url_queue_or_connection_option_is_refused_at_construction(sqlite_db: Any) -> None:
    dedup = Deduplicator(sqlite_db.engine, consumer="ledger", tables=sqlite_db.tables)
    handler = dedup.handler(lambda message, session: None)
    with pytest.raises(ConfigurationError, match="queue"):
        RabbitConsumerRunner(handler, "")
    with pytest.raises(ConfigurationError, match="no_such_option"):
        RabbitConsumerRunner(
            handler, "q", config=RabbitConfig(connection_options={"no_such_option": 1})
        )
    with pytest.raises(ConfigurationError, match="heartbeat"):
        RabbitConsumerRunner(
            handler, "q", config=RabbitConfig(connection_options={"heartbeat": "x"})
        )
    with pytest.raises(ConfigurationError):
        RabbitConsumerRunner(handler, "q", url="amqp://host:notaport/")


def test_a_quorum_queue_declared_by_the_runner_works_the_same(db: Any, rabbit: Broker) -> None:
    queue = rabbit.name("quorum")
    consumer = Consumer(
        db, rabbit, queue, declare=True, queue_arguments={"x-queue-type": "quorum"}, batch_size=4
    )
    consumer.runner.declare()
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(refuse="bad"), "m-2")
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(retries=1), "m-3")
    consumer.runner.run(until_idle=True)

    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    [(props, _)] = dead_letters(rabbit, queue)
    assert props.message_id == "m-2" and props.headers[REASON_HEADER] == "PermanentError: bad"
    assert rabbit.held(queue) == 0


def test_a_missing_processed_events_stops_the_runner_before_it_consumes(
    db: Any, rabbit: Broker
) -> None:
    """Doctor's start check (issue 23): one line naming the table and the fix, and the
    message stays on the queue, instead of `consuming ...` and a RETRY per delivery."""
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    consumer = Consumer(db, rabbit, queue)
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {db.name('processed_events')}")
    with pytest.raises(ConfigurationError) as refused:
        consumer.runner.run(until_idle=True)
    said = str(refused.value)
    assert db.tables.processed_events.fullname in said and "consumerdedup init-db" in said
    assert consumer.seen == [] and rabbit.held(queue) == 1
