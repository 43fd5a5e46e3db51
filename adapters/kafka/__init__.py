"""Kafka adapter (aiokafka): KafkaConsumerRunner and KafkaPublisher."""

try:
    import aiokafka  # type: ignore[import-untyped]  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.adapters.kafka needs aiokafka: pip install 'consumerdedup[kafka]'"
    ) from exc

from consumerdedup.headers import SOURCE_HEADER

from .config import DEFAULT_BOOTSTRAP, KafkaConfig, KeyFunction
from .convert import BODY_DROPPED_HEADER, OFFSET_HEADER, PARTITION_HEADER
from .errors import (
    AuthenticationFailed,
    BrokerRefused,
    BrokerUnavailable,
    DeadLetterMissing,
    KafkaAdapterError,
    PublishFailed,
    PublishRefused,
    TopicMissing,
    TopicRefused,
)
from .publisher import KafkaPublisher
from .runner import KafkaConsumerRunner

__all__ = [
    "BODY_DROPPED_HEADER",
    "DEFAULT_BOOTSTRAP",
    "OFFSET_HEADER",
    "PARTITION_HEADER",
    "SOURCE_HEADER",
    "AuthenticationFailed",
    "BrokerRefused",
    "BrokerUnavailable",
    "DeadLetterMissing",
    "KafkaAdapterError",
    "KafkaConfig",
    "KafkaConsumerRunner",
    "KafkaPublisher",
    "KeyFunction",
    "PublishFailed",
    "PublishRefused",
    "TopicMissing",
    "TopicRefused",
]
