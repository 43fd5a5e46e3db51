"""How many dead letters wait in dead-letter queues (RabbitMQ) and topics (Kafka), for
``doctor``; each broker's client imported only when asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from . import KAFKA_GROUP as GROUP


def rabbitmq_depths(url: str, queues: Sequence[str]) -> dict[str, int | None]:
    """How many messages each of ``queues`` holds now (ready ones); None for a queue the
    broker does not have."""
    import pika.exceptions  # type: ignore[import-untyped]

    from .rabbitmq import open_connection

    connection: Any = open_connection(url)
    found: dict[str, int | None] = {}
    try:
        channel = connection.channel()
        for queue in queues:
            try:
                declared = channel.queue_declare(queue, passive=True)
                found[queue] = int(declared.method.message_count)
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                found[queue] = None
                channel = connection.channel()  # a 404 closes the channel
    finally:
        connection.close() if connection.is_open else None
    return found


def kafka_depths(
    bootstrap_servers: str, topics: Sequence[str], *, group: str = GROUP
) -> dict[str, int | None]:
    """How many records of each of ``topics`` the replay group has not passed yet (from
    its committed offset, or the beginning, to the end); None for a topic not there."""
    return asyncio.run(_kafka_depths(bootstrap_servers, topics, group))


async def _kafka_depths(
    bootstrap_servers: str, topics: Sequence[str], group: str
) -> dict[str, int | None]:
    from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers, group_id=group, enable_auto_commit=False
    )
    await consumer.start()
    try:
        known = set(await consumer.topics())
        found: dict[str, int | None] = {}
        for topic in topics:
            if topic not in known:
                found[topic] = None
                continue
            partitions = [
                TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))
            ]
            ends = await consumer.end_offsets(partitions)
            starts = await consumer.beginning_offsets(partitions)
            waiting = 0
            for tp in partitions:
                committed = await consumer.committed(tp)
                waiting += max(ends[tp] - max(committed or 0, starts[tp]), 0)
            found[topic] = waiting
        return found
    finally:
        await consumer.stop()
