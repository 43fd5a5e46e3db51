"""RabbitMQ adapter (pika): RabbitConsumerRunner and RabbitPublisher."""

try:
    import pika  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.adapters.rabbitmq needs pika: pip install 'consumerdedup[rabbitmq]'"
    ) from exc
