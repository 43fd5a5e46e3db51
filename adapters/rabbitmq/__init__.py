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
from .convert import Delivery
from .errors import (
    BrokerUnavailable,
    ExchangeMissing,
    PublishFailed,
    PublishNacked,
    RabbitError,
    TopologyError,
    Unroutable,
)
from .publisher import RabbitPublisher, route
from .runner import RabbitConsumerRunner

__all__ = [
    "DEFAULT_URL",
    "SOURCE_HEADER",
    "BrokerUnavailable",
    "Delivery",
    "ExchangeMissing",
    "KeyFunction",
    "PublishFailed",
    "PublishNacked",
    "Publisher",
    "RabbitConfig",
    "RabbitConsumerRunner",
    "RabbitError",
    "RabbitPublisher",
    "TopologyError",
    "Unroutable",
    "route",
]
