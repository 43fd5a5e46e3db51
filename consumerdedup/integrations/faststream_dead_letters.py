"""A FAILED FastStream message's dead letter, published through the subscriber's own
FastStream broker, in the form the library's runners write (so ``consumerdedup failed
replay`` reads it like theirs).

``DedupMiddleware(dedup, dead_letters=broker)``: on FAILED, before FastStream's ack, the
message's body and headers go to ``<source>.dlq`` (Kafka: the topic, its key kept;
RabbitMQ: the queue, through the default exchange), with ``x-dead-letter-reason``,
``-consumer`` and ``-source``, and the message's id in ``event_id`` (a Kafka record keyed
by its coordinates keeps them as its id, so its replayed copy is the same message). If
the publish fails the message is nacked, not acked: it comes back, answers its FAILED
record, and is dead-lettered then. Kafka and RabbitMQ only: those are the brokers whose
dead-letter queues ``failed replay`` reads.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError
from ..headers import CONSUMER_HEADER, DEAD_LETTER_SUFFIX, ID_HEADER, REASON_HEADER, SOURCE_HEADER
from ..outcome import Result
from ..reasons import REASON_LIMIT

__all__ = ["REPLAYABLE", "check_broker", "publish_dead_letter"]

REPLAYABLE = ("kafka", "rabbit")
"""FastStream's broker modules whose dead letters ``consumerdedup failed replay`` reads."""


def check_broker(broker: Any) -> str:
    """``kafka`` or ``rabbit`` for a FastStream broker of those; else ConfigurationError."""
    kind = str(type(broker).__module__).split(".")
    if kind[0] != "faststream" or len(kind) < 2 or kind[1] not in REPLAYABLE:
        raise ConfigurationError(
            f"DedupMiddleware.dead_letters: {type(broker).__name__} given; expected a "
            "FastStream KafkaBroker or RabbitBroker (the dead-letter queues `consumerdedup "
            "failed replay` reads); on NATS and Redis keep a copy with the "
            "AsyncDeduplicator's dead_letter= callback"
        )
    return kind[1]


async def publish_dead_letter(broker: Any, kind: str, consumer: str, result: Result) -> None:
    """Publish ``result``'s message to its source's ``.dlq`` with the dead-letter headers."""
    message = result.message
    source = message.source or ""
    headers = {k: v for k, v in message.headers.items() if not k.startswith("x-dead-letter-")}
    headers.update(
        {
            REASON_HEADER: (result.reason or "")[:REASON_LIMIT],
            CONSUMER_HEADER: consumer,
            SOURCE_HEADER: source,
        }
    )
    if message.id is not None:
        headers[ID_HEADER] = message.id
    raw = getattr(message.raw, "raw_message", None)
    if kind == "kafka":
        key = getattr(raw, "key", None)
        await broker.publish(
            message.body, topic=source + DEAD_LETTER_SUFFIX, key=key, headers=headers
        )
    else:
        await broker.publish(
            message.body,
            queue=source + DEAD_LETTER_SUFFIX,
            headers=headers,
            message_id=message.id,
            content_type=getattr(raw, "content_type", None),
            persist=True,
        )
