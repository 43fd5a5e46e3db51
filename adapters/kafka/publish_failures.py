"""What a Kafka producer's failures mean for the publisher: a session to start again, a
broker away, or a refusal that names what to change."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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

from consumerdedup.reasons import describe

from . import connection
from .errors import BrokerRefused, BrokerUnavailable, PublishFailed

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
