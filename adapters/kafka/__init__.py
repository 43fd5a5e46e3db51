"""Kafka adapter (aiokafka): KafkaConsumerRunner and KafkaPublisher."""

try:
    import aiokafka  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.adapters.kafka needs aiokafka: pip install 'consumerdedup[kafka]'"
    ) from exc
