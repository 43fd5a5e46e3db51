"""KafkaPublisher: acks=all, keys and headers, returns once the broker has the record."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, KafkaTimeoutError, UnknownTopicOrPartitionError

from consumerdedup import ConfigurationError, Publisher
from consumerdedup.adapters.kafka import (
    BrokerRefused,
    BrokerUnavailable,
    KafkaPublisher,
    PublishFailed,
    TopicMissing,
)
from consumerdedup.errors import DestinationMissing
from tests.support.kafka_doubles import no_auto_create
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    free_port,
    kafka_fixture,
    refusing_broker,
    start_tansu,
    topics_fixture,
)


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


async def test_a_broker_refusal_is_publish_failed_with_the_cause(tmp_path: Path) -> None:
    """The broker refuses the record (a broker of the test's own whose schema registry no
    record of that topic passes): PublishFailed, not a broker away, and nothing stored."""
    topic = f"cdd-refused-{uuid.uuid4().hex[:10]}"
    async with refusing_broker(tmp_path, [topic]) as broker:
        await broker.create(name=topic)
        publisher = KafkaPublisher(broker.bootstrap, enable_idempotence=False)
        try:
            with pytest.raises(PublishFailed, match=f"cannot publish to '{topic}'") as caught:
                await publisher.publish(topic, b'{"n": 1}')
            assert not isinstance(caught.value, BrokerUnavailable | DestinationMissing)
            assert isinstance(caught.value.__cause__, KafkaError)
            await publisher.publish(topic + ".dlq", b'{"n": 1}')  # another topic: taken
        finally:
            await publisher.stop()
        assert await broker.records(topic) == []
        assert [r.value for r in await broker.records(topic + ".dlq")] == [b'{"n": 1}']


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
            # A setup fault, naming the option to change (issue 17, item 10).
            with pytest.raises(BrokerRefused, match=r"enable_idempotence=False.*--no-idempotence"):
                await publisher.publish(topic, b"x")
            assert await topics.records(topic) == []
    finally:
        await publisher.stop()


def test_options_that_would_weaken_the_guarantees_are_refused() -> None:
    for owned in ("acks", "enable_idempotence", "bootstrap_servers"):
        with pytest.raises(ConfigurationError, match=owned):
            KafkaPublisher(options={owned: 1})


async def no_answer(client: object, topic: str) -> None:
    """The topic check's answer when no broker answers its metadata request."""
    return None


@pytest.mark.parametrize("error", [UnknownTopicOrPartitionError, KafkaTimeoutError])
async def test_a_topic_the_broker_does_not_have_is_destination_missing_not_broker_unavailable(
    kafka: KafkaService, topics: Topics, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """aiokafka's answer for a missing topic is retriable, but the broker is there: the outbox
    relay must charge that event, not stop for everyone (see tests/support/kafka_doubles.py).
    The publisher's check before a first send (tests/kafka/test_topic_check.py) gets no
    answer here, so aiokafka's own error for the send is what tells."""
    double = no_auto_create(monkeypatch, error)
    monkeypatch.setattr("consumerdedup.adapters.kafka.publisher.topic_answer", no_answer)
    present = await topics.create("present")
    missing = f"cdd-missing-{uuid.uuid4().hex[:10]}"
    topics.names.append(missing)
    async with KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence) as publisher:
        with pytest.raises(TopicMissing, match=f"{missing!r} does not exist") as caught:
            await publisher.publish(missing, b"x")
        assert isinstance(caught.value, DestinationMissing)
        assert not isinstance(caught.value, ConnectionError | BrokerUnavailable)
        assert isinstance(caught.value.__cause__, error)
        await publisher.publish(present, b"y")
        # Known missing: asked of the broker's topic list and refused at once, not after
        # another request_timeout_ms in aiokafka.
        with pytest.raises(TopicMissing):
            await publisher.publish(missing, b"x")
        assert double.refused == [missing]
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:  # an operator creates the topic: its events go
            await admin.create_topics([NewTopic(missing, 1, 1)])
        finally:
            await admin.close()
        await publisher.publish(missing, b"z")
    assert [r.value for r in await topics.records(missing)] == [b"z"]
    assert [r.value for r in await topics.records(present)] == [b"y"]


async def test_a_broker_gone_after_start_is_broker_unavailable_whatever_the_topic() -> None:
    """A broker of our own, killed after the first publish: the same aiokafka errors as for
    a missing topic, but nobody answers, so it is the broker that is away."""
    port = free_port()
    broker = start_tansu(port)
    known = f"cdd-gone-{uuid.uuid4().hex[:10]}"
    publisher = KafkaPublisher(
        f"127.0.0.1:{port}", enable_idempotence=False, options={"request_timeout_ms": 1500}
    )
    try:
        await publisher.publish(known, b"x")  # Tansu creates the topic
        broker.kill()
        broker.wait()
        for topic in (known, f"cdd-never-{uuid.uuid4().hex[:10]}"):
            with pytest.raises(BrokerUnavailable) as caught:
                await publisher.publish(topic, b"y")
            assert not isinstance(caught.value, DestinationMissing)
    finally:
        broker.kill()
        broker.wait()
        await publisher.stop()
