"""The Kafka adapter's errors, in the consumerdedup tree."""

from __future__ import annotations

from consumerdedup import ConsumerDedupError


class KafkaAdapterError(ConsumerDedupError):
    """Root of what this adapter raises on purpose."""


class PublishFailed(KafkaAdapterError):
    """The broker did not acknowledge a record (the aiokafka error is the ``__cause__``)."""
