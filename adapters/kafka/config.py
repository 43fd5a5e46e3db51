"""KafkaConfig: how a KafkaConsumerRunner consumes, retries and dead-letters."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from consumerdedup import ConfigurationError, Message
from consumerdedup.headers import DEAD_LETTER_SUFFIX, ID_HEADER
from consumerdedup.retry import Backoff

from .connection import PUBLISHER_OWNED, RUNNER_OWNED, reject_owned

DEFAULT_BOOTSTRAP = "localhost:9092"
MAX_TOPIC_LENGTH = 249
"""Kafka refuses longer topic names (InvalidTopicException)."""

KeyFunction = Callable[[Message], str | None]
"""Finds the dedup id of a record without an id header: called with the Message (``id``
None, ``raw`` the aiokafka ConsumerRecord); None means it has none."""


@dataclass(frozen=True)
class KafkaConfig:
    """Consumer settings, validated at construction; durations are ``timedelta``."""

    batch_size: int = 100
    """Records of one partition per fetch at most: one chunk, one database transaction."""
    partitions_in_flight: int = 4
    """Partitions of one fetch handled at once, each chunk in its own transaction on its own
    database connection (so at most the handler's engine ``pool_size``; 1 on SQLite); each
    partition's chunks stay in offset order. 1: one partition after another."""
    poll_timeout: timedelta = timedelta(milliseconds=500)
    """Longest wait in ``getmany``: bounds how late ``stop()`` is noticed when idle."""
    retry_delay: timedelta = timedelta(seconds=1)
    """After a RETRY the partition is paused this long, then re-read from that record;
    doubled per RETRY of the same record in a row, up to ``max_retry_delay``."""
    max_retry_delay: timedelta = timedelta(seconds=30)
    id_header: str = ID_HEADER
    """Header carrying the dedup id (UTF-8)."""
    key: KeyFunction | None = None
    """Used when the id header is absent."""
    coordinates_as_id: bool = True
    """Last resort: ``topic:partition:offset`` (``sha256:<topic digest>:partition:offset``
    past 255 characters), stable across redeliveries of one record.
    False: a record with no id header and no key is dead-lettered instead."""
    dead_letter_topic: str = "{topic}" + DEAD_LETTER_SUFFIX
    """Where FAILED records go; ``{topic}`` is replaced by the record's topic."""
    idempotent_producer: bool = True
    """Idempotence for the dead-letter producer; off for brokers without InitProducerId."""
    consumer_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to ``AIOKafkaConsumer`` (``{"session_timeout_ms": 10000}``, security...).
    ``auto_offset_reset`` defaults to ``"earliest"``: a new group misses nothing."""
    producer_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the dead-letter ``AIOKafkaProducer``."""
    retry_backoff: timedelta | None = field(default=None, repr=False)
    """Deprecated: ``retry_delay`` (the name RabbitConfig has too)."""

    def __post_init__(self) -> None:
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigurationError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if not isinstance(self.partitions_in_flight, int) or self.partitions_in_flight < 1:
            raise ConfigurationError(
                f"partitions_in_flight must be an int >= 1, got {self.partitions_in_flight!r}"
            )
        if self.poll_timeout <= timedelta(0):
            raise ConfigurationError("poll_timeout must be positive")
        if self.retry_backoff is not None:
            warnings.warn(
                "KafkaConfig(retry_backoff=...) is deprecated: use retry_delay",
                DeprecationWarning,
                3,
            )
            object.__setattr__(self, "retry_delay", self.retry_backoff)
            object.__setattr__(
                self, "max_retry_delay", max(self.max_retry_delay, self.retry_backoff)
            )
            # Folded in: a later replace(retry_delay=...) must not be overridden by it again.
            object.__setattr__(self, "retry_backoff", None)
        if self.retry_delay < timedelta(0):
            raise ConfigurationError("retry_delay must not be negative")
        if self.max_retry_delay < self.retry_delay:
            raise ConfigurationError("need retry_delay <= max_retry_delay")
        if not isinstance(self.id_header, str) or not self.id_header:
            raise ConfigurationError("id_header must be a non-empty str")
        if self.key is not None and not callable(self.key):
            raise ConfigurationError("key must be a callable taking a Message")
        try:
            probe = self.dead_letter_topic.format(topic="t")
        except (AttributeError, KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(
                f"dead_letter_topic must be a str using only {{topic}}, got "
                f"{self.dead_letter_topic!r}"
            ) from exc
        if not probe or probe == "t":
            raise ConfigurationError("dead_letter_topic must name a topic other than the source")
        reject_owned("consumer_options", self.consumer_options, RUNNER_OWNED)
        reject_owned("producer_options", self.producer_options, PUBLISHER_OWNED)

    @property
    def redelivery_backoff(self) -> Backoff:
        """Before a RETRY record is read again, by its RETRYs in a row."""
        return Backoff(self.retry_delay, self.max_retry_delay, jitter=False)

    def dead_letters_of(self, topic: str) -> str:
        return self.dead_letter_topic.format(topic=topic)

    def check_dead_letters(self, topics: Sequence[str]) -> None:
        """Refuse a dead-letter topic Kafka cannot have: every dead letter would fail, and
        its partition would stop there for good."""
        for topic in topics:
            name = self.dead_letters_of(topic)
            if len(name) > MAX_TOPIC_LENGTH:
                raise ConfigurationError(
                    f"the dead-letter topic of {topic[:40]!r}... would be {len(name)} characters "
                    f"long, Kafka's limit is {MAX_TOPIC_LENGTH}: set "
                    "KafkaConfig(dead_letter_topic=...)"
                )
