"""Long topic and queue names: the id of a Kafka record without an id header (its coordinates)
is made to fit the id limit (the conversion itself, then end to end on the real broker), and a
dead-letter topic or queue the broker could not have is refused at construction."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord  # type: ignore[import-untyped]

from consumerdedup import MAX_ID_LENGTH, ConfigurationError, Deduplicator, Outcome
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.kafka.convert import to_message
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.message import validate_id
from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

LONG = "t" * 250


@pytest.fixture
async def ledger(pg: Any) -> Any:
    ledger = Ledger(pg)
    yield ledger
    await ledger.close()


def record(topic: str, partition: int = 0, offset: int = 0) -> Any:
    return ConsumerRecord(topic, partition, offset, 0, 0, None, b"{}", None, 0, 2, [])


def message_id(topic: str, partition: int = 0, offset: int = 0) -> Any:
    message, refusal = to_message(record(topic, partition, offset), KafkaConfig())
    assert refusal is None
    return validate_id(message.id)  # the core's own check: InvalidMessage if it does not fit


def test_a_short_topic_keeps_its_readable_coordinates() -> None:
    assert message_id("payments", 3, 42) == "payments:3:42"
    edge = "e" * (MAX_ID_LENGTH - len(":0:0"))
    assert message_id(edge) == f"{edge}:0:0"  # exactly at the limit: still readable


def test_a_long_topic_gets_a_hashed_id_that_fits_and_is_stable() -> None:
    digest = hashlib.sha256(LONG.encode()).hexdigest()
    assert message_id(LONG, 7, 123456789) == f"sha256:{digest}:7:123456789"
    longest = message_id(LONG, 2**31 - 1, 2**63 - 1)
    assert len(longest) <= MAX_ID_LENGTH
    assert message_id(LONG, 0, 5) == message_id(LONG, 0, 5)  # a redelivery: the same id
    ids = {message_id(LONG, p, o) for p in range(3) for o in range(3)}
    assert len(ids) == 9
    assert message_id(LONG) != message_id("u" * 250)


async def test_id_less_records_of_a_250_character_topic_are_processed_once(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("x" * (250 - len("cdd--0123456789")))
    assert len(topic) == 250
    total = 102  # from offset 100 on, topic:partition:offset is 256 characters or more
    for n in range(total):
        await topics.produce(topic, body(n))
    dead_letters = await topics.create("dlq")
    first = runner(kafka, ledger.handle, topic, dead_letter_topic=dead_letters)
    await first.run(until_idle=True)
    digest = hashlib.sha256(topic.encode()).hexdigest()
    expected = [f"{topic}:0:{n}" for n in range(100)] + [
        f"sha256:{digest}:0:{n}" for n in (100, 101)
    ]
    assert sorted(ledger.applied()) == sorted(expected)
    assert first.outcomes == {Outcome.PROCESSED: total}
    assert await topics.records(dead_letters) == []

    # Read again from the start by another group: the same ids, so nothing applies twice.
    again = runner(
        kafka, ledger.handle, topic, group_id="again-" + topic[:20], dead_letter_topic=dead_letters
    )
    await again.run(until_idle=True)
    assert again.outcomes == {Outcome.DUPLICATE: total}
    assert len(ledger.applied()) == total


def test_dead_letter_names_the_broker_cannot_have_are_refused_at_construction(
    sqlite_db: Any,
) -> None:
    handler = Deduplicator(sqlite_db.engine, tables=sqlite_db.tables, consumer="c").handler(
        lambda message, session: None
    )
    topic, queue = "t" * 246, "q" * 252
    with pytest.raises(ConfigurationError, match="250 characters long, Kafka's limit is 249"):
        KafkaConsumerRunner(handler, topic)
    KafkaConsumerRunner(handler, topic, config=KafkaConfig(dead_letter_topic="dead"))
    with pytest.raises(ConfigurationError, match="256 bytes long, AMQP's limit is 255"):
        RabbitConsumerRunner(handler, queue)
    RabbitConsumerRunner(handler, queue, config=RabbitConfig(dead_letter_queue="dead"))
    with pytest.raises(ConfigurationError, match="255 bytes at most"):
        RabbitConsumerRunner(handler, "é" * 128, config=RabbitConfig(dead_letter_queue="dead"))
