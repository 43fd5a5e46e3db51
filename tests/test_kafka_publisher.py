"""KafkaPublisher: acks=all, keys and headers, returns once the broker has the record."""

from __future__ import annotations

import pytest

from consumerdedup import ConfigurationError, Publisher
from consumerdedup.adapters.kafka import KafkaPublisher, PublishFailed
from tests.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401


async def test_publish_sends_body_key_and_headers_and_returns_once_acknowledged(
    kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("publish")
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)
    relay_side: Publisher = publisher  # what the outbox relay will hold
    async with publisher:
        await relay_side.publish(topic, b'{"n": 1}', key="order-1", headers={"event_id": "e-1"})
        await relay_side.publish(topic, b'{"n": 2}')
    [first, second] = await topics.records(topic)  # there as soon as publish returned
    assert (first.value, first.key, list(first.headers)) == (
        b'{"n": 1}',
        b"order-1",
        [("event_id", b"e-1")],
    )
    assert (second.value, second.key, list(second.headers)) == (b'{"n": 2}', None, [])


async def test_send_takes_raw_headers_and_returns_the_record_metadata(
    kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("send", partitions=2)
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)
    try:  # started on first use
        sent = await publisher.send(topic, b"x", key=b"k", headers=[("h", b"1"), ("h", b"2")])
    finally:
        await publisher.stop()
    [record] = await topics.records(topic)
    assert (record.partition, record.offset) == (sent.partition, sent.offset)
    assert list(record.headers) == [("h", b"1"), ("h", b"2")]


async def test_a_broker_refusal_is_publish_failed_with_the_cause(
    kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("refused")
    tiny = KafkaPublisher(
        kafka.bootstrap,
        enable_idempotence=kafka.idempotence,
        options={"max_request_size": 16},
    )
    with pytest.raises(PublishFailed, match=f"cannot publish to '{topic}'") as caught:
        await tiny.publish(topic, b"more than sixteen bytes of body")
    assert caught.value.__cause__ is not None
    await tiny.stop()
    assert await topics.records(topic) == []


async def test_idempotence_is_on_by_default_and_a_broker_without_it_fails_loudly(
    kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("idempotent")
    publisher = KafkaPublisher(kafka.bootstrap)  # enable_idempotence=True by default
    try:
        if kafka.idempotence:
            await publisher.publish(topic, b"x")
            assert len(await topics.records(topic)) == 1
        else:  # Tansu: no InitProducerId, so the producer cannot start; nothing is sent
            with pytest.raises(PublishFailed):
                await publisher.publish(topic, b"x")
            assert await topics.records(topic) == []
    finally:
        await publisher.stop()


def test_options_that_would_weaken_the_guarantees_are_refused() -> None:
    for owned in ("acks", "enable_idempotence", "bootstrap_servers"):
        with pytest.raises(ConfigurationError, match=owned):
            KafkaPublisher(options={owned: 1})
