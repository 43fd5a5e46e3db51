"""RabbitPublisher on the real broker: confirmed, persistent, mandatory, id carried along."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    ConfigurationError,
    Deduplicator,
    DestinationMissing,
    InvalidMessage,
    Message,
    Outcome,
    Publisher,
)
from consumerdedup.adapters.rabbitmq import (
    BrokerUnavailable,
    PublishFailed,
    RabbitConfig,
    RabbitConsumerRunner,
    RabbitPublisher,
    Unroutable,
    route,
)
from consumerdedup.retry import ErrorKind, classify
from tests.support.rabbitmq_service import (  # noqa: F401
    Broker,
    amqp_url_fixture,
    close_connection,
    rabbit_fixture,
)


@pytest.fixture
def publisher(rabbit: Broker) -> Iterator[RabbitPublisher]:
    with RabbitPublisher(rabbit.url) as p:
        yield p


def test_a_message_to_a_queue_is_persistent_and_carries_its_event_id(
    rabbit: Broker, publisher: RabbitPublisher
) -> None:
    queue = rabbit.queue()
    publisher.publish(queue, b"hello", headers={"event_id": "evt-1", "trace": "t"})
    [(props, body)] = rabbit.peek(queue)
    assert body == b"hello"
    assert props.message_id == "evt-1" and props.delivery_mode == 2
    assert props.headers == {"event_id": "evt-1", "trace": "t"}


def test_an_exchange_destination_routes_by_its_key_or_by_the_message_key(
    rabbit: Broker, publisher: RabbitPublisher
) -> None:
    exchange, queue = rabbit.name("ex"), rabbit.queue()
    rabbit.channel.exchange_declare(exchange, exchange_type="direct")
    rabbit.channel.queue_bind(queue, exchange, routing_key="order.created")
    publisher.publish(f"{exchange}/order.created", b"1", headers={"event_id": "e-1"})
    publisher.publish(f"{exchange}/", b"2", key="order.created", headers={"event_id": "e-2"})
    assert [props.message_id for props, _ in rabbit.peek(queue)] == ["e-1", "e-2"]


def test_an_unroutable_message_is_reported(rabbit: Broker, publisher: RabbitPublisher) -> None:
    exchange = rabbit.name("ex")
    rabbit.channel.exchange_declare(exchange, exchange_type="direct")
    with pytest.raises(Unroutable, match="no queue is bound") as caught:
        publisher.publish(f"{exchange}/nobody", b"x", headers={"event_id": "e-1"})
    assert isinstance(caught.value, DestinationMissing)  # charged, not an outage
    with pytest.raises(Unroutable):
        publisher.publish(rabbit.name("no-queue"), b"x", headers={"event_id": "e-2"})


def test_a_missing_exchange_is_reported_and_the_publisher_goes_on(
    rabbit: Broker, publisher: RabbitPublisher
) -> None:
    with pytest.raises(PublishFailed, match="NOT_FOUND") as caught:
        publisher.publish(f"{rabbit.name('gone')}/key", b"x", headers={"event_id": "e-1"})
    assert isinstance(caught.value, DestinationMissing)  # charged, not an outage
    assert classify(caught.value) is not ErrorKind.TRANSIENT
    queue = rabbit.queue()
    publisher.publish(queue, b"y", headers={"event_id": "e-2"})
    assert rabbit.ready(queue) == 1


@pytest.mark.parametrize("headers", [None, {}, {"event_id": ""}, {"event_id": "é" * 200}])
def test_a_message_without_a_usable_event_id_is_refused(
    publisher: RabbitPublisher, headers: Any
) -> None:
    with pytest.raises(InvalidMessage, match="event_id"):
        publisher.publish("q", b"x", headers=headers)


def test_a_connection_closed_by_the_broker_is_reopened_on_the_next_publish(
    rabbit: Broker,
) -> None:
    queue = rabbit.queue()
    with RabbitPublisher(rabbit.url, connection_name=f"{queue}-publisher") as publisher:
        publisher.publish(queue, b"1", headers={"event_id": "e-1"})
        close_connection(rabbit.url, publisher.name)
        publisher.publish(queue, b"2", headers={"event_id": "e-2"})
    assert [props.message_id for props, _ in rabbit.peek(queue)] == ["e-1", "e-2"]


def test_publish_is_thread_safe(rabbit: Broker, publisher: RabbitPublisher) -> None:
    queue = rabbit.queue()

    def send(worker: int) -> None:
        for i in range(50):
            publisher.publish(queue, b"x", headers={"event_id": f"e-{worker}-{i}"})

    threads = [threading.Thread(target=send, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert rabbit.ready(queue) == 200


def test_a_message_published_twice_is_applied_once_downstream(
    db: Any, rabbit: Broker, publisher: RabbitPublisher
) -> None:
    queue = rabbit.queue()
    for _ in range(2):  # a relay that lost the first confirm publishes again
        publisher.publish(queue, b'{"amount": 3}', headers={"event_id": "evt-7"})
    ledger = db.create_ledger()
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)

    @dedup.handler
    def apply(message: Message, session: Any) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 3, :m)"),
            {"m": message.id},
        )

    config = RabbitConfig(idle_timeout=timedelta(milliseconds=300))
    runner = RabbitConsumerRunner(apply, queue, url=rabbit.url, config=config)
    runner.run(until_idle=True)
    assert runner.outcomes == {Outcome.PROCESSED: 1, Outcome.DUPLICATE: 1}
    assert db.scalar(f"SELECT count(*) FROM {ledger}") == 1


def test_an_unreachable_broker_is_a_transient_error_for_the_relay() -> None:
    publisher = RabbitPublisher(
        "amqp://guest:guest@127.0.0.1:1/%2F", attempts=1, connect_timeout=timedelta(seconds=1)
    )
    with pytest.raises(BrokerUnavailable) as caught:
        publisher.publish("q", b"x", headers={"event_id": "e-1"})
    assert classify(caught.value) is ErrorKind.TRANSIENT


def test_route() -> None:
    assert route("payments") == ("", "payments")
    assert route("events/order.created") == ("events", "order.created")
    assert route("events/", "k-1") == ("events", "k-1")
    assert route("events/") == ("events", "")
    with pytest.raises(InvalidMessage):
        route("")


def test_it_is_a_publisher_and_checks_its_settings() -> None:
    publisher: Publisher = RabbitPublisher()  # the protocol the outbox relay takes
    assert isinstance(publisher, Publisher)
    with pytest.raises(ConfigurationError):
        RabbitPublisher(attempts=0)
    with pytest.raises(ConfigurationError):
        RabbitPublisher(connect_timeout=timedelta(0))
