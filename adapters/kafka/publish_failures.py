"""What a Kafka producer's failures mean for the publisher: a session to start again, a
broker away, or a refusal that names what to change; and what the broker says of a topic
before the first send to it."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiokafka import errors as kafka_errors  # type: ignore[import-untyped]
from aiokafka.errors import (  # type: ignore[import-untyped]
    ClusterAuthorizationFailedError,
    DuplicateSequenceNumber,
    InvalidProducerEpoch,
    InvalidProducerIdMapping,
    KafkaError,
    KafkaTimeoutError,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    UnknownProducerId,
)
from aiokafka.protocol.metadata import MetadataRequest  # type: ignore[import-untyped]

from consumerdedup.reasons import describe

from . import connection
from .errors import (
    BrokerRefused,
    BrokerUnavailable,
    PublishFailed,
    TopicMissing,
    TopicRefused,
)

PRODUCER_STATE = (
    ClusterAuthorizationFailedError,
    DuplicateSequenceNumber,
    InvalidProducerEpoch,
    InvalidProducerIdMapping,
    OutOfOrderSequenceNumber,
    ProducerClosed,
    ProducerFenced,
    UnknownProducerId,
)
"""Not retriable in aiokafka's words, yet about the producer's session (its id, epoch,
sequence), not the record: a new producer may send the same record."""


def start_failure(exc: KafkaError, settings: Mapping[str, Any]) -> PublishFailed | BrokerRefused:
    """A producer that cannot start: no broker answers (retriable, BrokerUnavailable), or one
    refuses it (BrokerRefused, a ConfigurationError naming what to change)."""
    reason = f"cannot start the Kafka producer: {describe(exc)}"
    if isinstance(exc, connection.SASL_FAILURES):
        return connection.authentication_failed(exc, settings["bootstrap_servers"])
    if getattr(exc, "retriable", False) or isinstance(exc, KafkaTimeoutError):
        return BrokerUnavailable(reason)
    where = settings["bootstrap_servers"]
    if settings["enable_idempotence"]:
        return BrokerRefused(
            f"the Kafka broker at {where} refused an idempotent producer ({describe(exc)}); "
            "a broker without idempotent producers (Tansu, some managed services) needs them "
            "off: KafkaPublisher(enable_idempotence=False), consumerdedup relay "
            "--no-idempotence, KafkaConfig(idempotent_producer=False) for a runner's dead letters"
        )
    return BrokerRefused(
        f"the Kafka broker at {where} refused the producer ({describe(exc)}): check the "
        "security options (security_protocol, sasl_*) and the ACLs"
    )


ASK_TIMEOUT = 10.0
"""Seconds the broker has to answer a metadata request about one topic."""


async def topic_answer(client: Any, topic: str) -> Any:
    """aiokafka's error class for the broker's answer about ``topic`` (NoError: it has it),
    to a metadata request that lets it create the topic as a send would; None without one.

    Asked before the first send to a topic: handed to the producer, a topic the broker does
    not have and will not create, or whose name it refuses, made aiokafka wait
    ``request_timeout_ms`` (40 s) for it, logging an ERROR line every 100 ms."""
    node = None if client is None else client.get_random_node()
    if node is None:
        return None
    try:
        request = MetadataRequest([topic], allow_auto_topic_creation=True)
        answer = await asyncio.wait_for(client.send(node, request), ASK_TIMEOUT)
    except (KafkaError, TimeoutError, OSError):
        return None
    codes = [entry[0] for entry in answer.topics if entry[1] == topic]
    return kafka_errors.for_code(codes[0]) if codes else None


def topic_refusal(topic: str, answer: Any) -> PublishFailed | None:
    """What ``answer`` (``topic_answer``'s) means for a send: TopicMissing (not there, not
    created), TopicRefused (the topic itself refused: its name, a policy), or None (there,
    or it may be: the send tells; no right to write to it is the record's refusal)."""
    reason = f"cannot publish to {topic!r}"
    if answer is kafka_errors.UnknownTopicOrPartitionError:
        return TopicMissing(f"{reason}: topic {topic!r} does not exist")
    if answer is None or answer is kafka_errors.NoError or answer.retriable:
        return None
    if answer is kafka_errors.TopicAuthorizationFailedError:
        return None
    return TopicRefused(
        f"{reason}: the broker refuses the topic ({answer.__name__}: {answer.description})"
    )
