"""KafkaConfig: how a KafkaConsumerRunner consumes, retries and dead-letters."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError, Message
from consumerdedup.headers import DEAD_LETTER_SUFFIX, ID_HEADER
from consumerdedup.options import (
    boolean,
    choice,
    duration,
    function,
    integer,
    mapping,
    matching,
    maybe,
    refuse,
    settle,
    text,
)
from consumerdedup.retry import Backoff

from .connection import PUBLISHER_OWNED, RUNNER_OWNED, reject_owned

DEFAULT_BOOTSTRAP = "localhost:9092"
MAX_TOPIC_LENGTH = 249
"""Kafka refuses longer topic names (InvalidTopicException)."""
TOPIC_NAME = re.compile(r"(?!\.\.?$)[a-zA-Z0-9._-]{1,249}")
TOPIC_RULE = "a Kafka topic name: a-z A-Z 0-9 . _ -, at most 249 characters, not '.' or '..'"
CONSUMED_TOPIC = re.compile(r"(?!\.\.?$)[a-zA-Z0-9._-]+")
"""A topic to consume: Kafka's characters; its length is the broker's to judge (one that
has it, has it)."""
CONSUMED_RULE = "a Kafka topic name: a-z A-Z 0-9 . _ -, not '.' or '..'"
TOPIC_TEMPLATE = re.compile(r"(?:[a-zA-Z0-9._-]|\{topic\})+")
TEMPLATE_RULE = "a topic name of a-z A-Z 0-9 . _ - in which {topic} is the record's topic"
CONSUMER_OPTIONS = frozenset(inspect.signature(AIOKafkaConsumer).parameters) - {"topics"}
PRODUCER_OPTIONS = frozenset(inspect.signature(AIOKafkaProducer).parameters)
_PASSED_THROUGH = {
    "consumer_options": (CONSUMER_OPTIONS, "an AIOKafkaConsumer argument"),
    "producer_options": (PRODUCER_OPTIONS, "an AIOKafkaProducer argument"),
}

OFFSET_MODES = ("broker", "database")
"""KafkaConfig.offsets: where a partition's position is the truth."""

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
    """Where FAILED records go; ``{topic}`` is replaced by the record's topic. Kafka's
    characters only (a-z A-Z 0-9 . _ -), checked at construction, as the length is when
    the runner knows its topics."""
    idempotent_producer: bool = True
    """Idempotence for the dead-letter producer; off for brokers without InitProducerId."""
    consumer_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to ``AIOKafkaConsumer`` (``{"session_timeout_ms": 10000}``, security...).
    ``auto_offset_reset`` defaults to ``"earliest"``: a new group misses nothing."""
    producer_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to the dead-letter ``AIOKafkaProducer``."""
    offsets: str = "broker"
    """Where a partition's position is the truth. ``"broker"``: the group's committed
    offset, committed after each chunk's transaction (a redelivery after a crash between
    the two is answered DUPLICATE from processed_events). ``"database"``: the
    consumer_offsets table, written in each chunk's own transaction and fenced by an owner
    epoch against a consumer that lost the partition; assignment seeks to it; the broker
    commit still follows, for lag tooling (docs/kafka.md: Offsets in the database)."""
    claim_ids: bool = True
    """With ``offsets="database"``: claim each record's id in processed_events too, so a
    producer's retried copy (the same id at another offset) is answered DUPLICATE. False:
    the offset alone decides, no row per record (an idempotent producer, or none that
    retries); FAILED records keep theirs. See the guarantee table in docs/kafka.md."""
    retry_backoff: timedelta | None = field(default=None, repr=False)
    """Deprecated: ``retry_delay`` (the name RabbitConfig has too)."""

    def __post_init__(self) -> None:
        option = "KafkaConfig."
        for name in ("batch_size", "partitions_in_flight"):
            settle(self, name, integer(getattr(self, name), option + name, at_least=1))
        settle(self, "poll_timeout", duration(self.poll_timeout, option + "poll_timeout"))
        backoff = maybe(self.retry_backoff, option + "retry_backoff", duration, zero=True)
        if backoff is not None:
            warnings.warn(
                "KafkaConfig(retry_backoff=...) is deprecated: use retry_delay",
                DeprecationWarning,
                3,
            )
            settle(self, "retry_delay", backoff)
            longest = duration(self.max_retry_delay, option + "max_retry_delay", zero=True)
            settle(self, "max_retry_delay", max(longest, backoff))
            # Folded in: a later replace(retry_delay=...) must not be overridden by it again.
            settle(self, "retry_backoff", None)
        delay = duration(self.retry_delay, option + "retry_delay", zero=True)
        settle(self, "retry_delay", delay)
        longest = duration(self.max_retry_delay, option + "max_retry_delay", at_least=delay)
        settle(self, "max_retry_delay", longest)
        text(self.id_header, option + "id_header")
        maybe(self.key, option + "key", function, "a callable taking a Message")
        for name in ("coordinates_as_id", "idempotent_producer", "claim_ids"):
            settle(self, name, boolean(getattr(self, name), option + name))
        settle(self, "offsets", choice(self.offsets, option + "offsets", OFFSET_MODES))
        if not self.claim_ids and self.offsets != "database":
            raise refuse(
                option + "claim_ids",
                self.claim_ids,
                'True unless offsets="database" (only offsets kept in the database can '
                "tell what was applied without a processed_events row)",
            )
        self._check_dead_letter_topic()
        for name, (allowed, known) in _PASSED_THROUGH.items():
            given = mapping(getattr(self, name), option + name, allowed=allowed, allowed_are=known)
            settle(self, name, given)
        reject_owned("consumer_options", self.consumer_options, RUNNER_OWNED)
        reject_owned("producer_options", self.producer_options, PUBLISHER_OWNED)

    def _check_dead_letter_topic(self) -> None:
        """Only Kafka's characters and ``{topic}``, naming a topic other than the source: a
        name the broker refuses fails every dead letter, and its partition stops there."""
        option, template = "KafkaConfig.dead_letter_topic", self.dead_letter_topic
        matching(template, option, TOPIC_TEMPLATE, TEMPLATE_RULE)
        if template.replace("{topic}", "t") == "t":
            raise refuse(option, template, "a topic other than the source ('{topic}.dlq')")
        if "{topic}" not in template:
            matching(template, option, TOPIC_NAME, TOPIC_RULE)

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
