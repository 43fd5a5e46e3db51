"""RabbitMQ adapter (pika): RabbitConsumerRunner and RabbitPublisher."""

try:
    import pika  # type: ignore[import-untyped]  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.adapters.rabbitmq needs pika: pip install 'consumerdedup[rabbitmq]'"
    ) from exc

from consumerdedup.headers import SOURCE_HEADER
from consumerdedup.outbox.publisher import Publisher

from .config import DEFAULT_URL, KeyFunction, RabbitConfig
from .convert import BODY_DROPPED_HEADER, Delivery
from .errors import (
    AuthenticationFailed,
    BrokerRefused,
    BrokerUnavailable,
    DeadLetterMissing,
    ExchangeMissing,
    PublishFailed,
    PublishNacked,
    PublishRefused,
    RabbitError,
    TopologyError,
    Unroutable,
)
from .outgoing import route
from .publisher import RabbitPublisher
from .runner import RabbitConsumerRunner

__all__ = [
    "BODY_DROPPED_HEADER",
    "DEFAULT_URL",
    "SOURCE_HEADER",
    "AuthenticationFailed",
    "BrokerRefused",
    "BrokerUnavailable",
    "DeadLetterMissing",
    "Delivery",
    "ExchangeMissing",
    "KeyFunction",
    "PublishFailed",
    "PublishNacked",
    "PublishRefused",
    "Publisher",
    "RabbitConfig",
    "RabbitConsumerRunner",
    "RabbitError",
    "RabbitPublisher",
    "TopologyError",
    "Unroutable",
    "route",
]
