"""RabbitConfig: how a RabbitConsumerRunner consumes one queue."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from consumerdedup import ConfigurationError, Message
from consumerdedup.headers import DEAD_LETTER_SUFFIX, ID_HEADER
from consumerdedup.retry import Backoff

DEFAULT_URL = "amqp://guest:guest@localhost:5672/%2F"
MAX_NAME_BYTES = 255
"""AMQP short strings: queue names and routing keys (UTF-8 bytes)."""

KeyFunction = Callable[[Message], str | None]
"""Finds the dedup id of a delivery that has no ``message_id`` and no id header (None: none)."""


@dataclass(frozen=True)
class RabbitConfig:
    """Consumer settings, validated at construction; durations are ``timedelta``."""

    prefetch: int = 200
    """``basic_qos`` prefetch_count: deliveries the broker hands out ahead of the acks. Twice
    ``batch_size`` by default: with no more than a batch in flight, the next batch only
    starts arriving once this one is acked, and batches come in short (measured: prefetch 100
    at batch 100 made 120-143 transactions of 9,000 messages, many of 1-40, against 90-94
    at prefetch 200, and about half the rate)."""
    batch_size: int = 100
    """Messages per database transaction at most (and at most ``prefetch``): what has arrived,
    up to this many, runs as one batch; a lone message does not wait for company."""
    id_header: str = ID_HEADER
    """Header read for the dedup id when the AMQP ``message_id`` property is absent."""
    key: KeyFunction | None = None
    """Last resort for the id: called with the Message (``id`` None); may parse the body."""
    declare: bool = False
    """Declare the queue (durable, with the dead-letter arguments), the DLQ and the DLX."""
    queue_arguments: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``queue_declare`` arguments when ``declare`` (``{"x-queue-type": "quorum"}``)."""
    dead_letter_exchange: str = ""
    """Where dead letters are published; "" is the default exchange (routes by queue name)."""
    dead_letter_queue: str | None = None
    """The dead-letter queue (and routing key); None means ``<queue>.dlq``."""
    retry_delay: timedelta = timedelta(seconds=1)
    """First wait before a RETRY message is given back; doubles per consecutive RETRY."""
    max_retry_delay: timedelta = timedelta(seconds=30)
    reconnect_delay: timedelta = timedelta(milliseconds=500)
    """First wait before reconnecting; exponential with jitter (tenacity) up to the max."""
    max_reconnect_delay: timedelta = timedelta(seconds=30)
    reconnect_timeout: timedelta | None = None
    """Give up (BrokerUnavailable) after this long without a connection; None: never."""
    idle_timeout: timedelta = timedelta(seconds=1)
    """With ``run(until_idle=True)``: return once no delivery came for this long."""
    connection_name: str | None = None
    """Client-provided connection name shown by the broker; None: one is made up."""
    connection_options: Mapping[str, Any] = field(default_factory=dict)
    """pika ConnectionParameters attributes set over the URL's (``{"heartbeat": 30}``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.prefetch, int) or not 1 <= self.prefetch <= 65535:
            raise ConfigurationError(f"prefetch must be an int in 1..65535, got {self.prefetch!r}")
        if not isinstance(self.batch_size, int) or not 1 <= self.batch_size <= self.prefetch:
            raise ConfigurationError(
                f"batch_size must be an int in 1..prefetch ({self.prefetch}), "
                f"got {self.batch_size!r}"
            )
        if not isinstance(self.id_header, str) or not self.id_header:
            raise ConfigurationError("id_header must be a non-empty str")
        if self.key is not None and not callable(self.key):
            raise ConfigurationError("key must be a callable taking a Message")
        if self.dead_letter_queue is not None and not self.dead_letter_queue:
            raise ConfigurationError("dead_letter_queue must be a non-empty name or None")
        for name in ("retry_delay", "reconnect_delay", "idle_timeout"):
            if getattr(self, name) < timedelta(0):
                raise ConfigurationError(f"{name} must not be negative")
        if self.max_retry_delay < self.retry_delay:
            raise ConfigurationError("need retry_delay <= max_retry_delay")
        if self.max_reconnect_delay < self.reconnect_delay:
            raise ConfigurationError("need reconnect_delay <= max_reconnect_delay")
        if self.reconnect_timeout is not None and self.reconnect_timeout <= timedelta(0):
            raise ConfigurationError("reconnect_timeout must be positive or None")

    @property
    def reconnect_backoff(self) -> Backoff:
        """Between connection attempts, and after lost connections in a row."""
        return Backoff(self.reconnect_delay, self.max_reconnect_delay)

    @property
    def redelivery_backoff(self) -> Backoff:
        """Before a RETRY message is given back, by its RETRYs in a row."""
        return Backoff(self.retry_delay, self.max_retry_delay, jitter=False)

    def dead_letters_of(self, queue: str) -> str:
        """The dead-letter queue of ``queue``; ConfigurationError if AMQP cannot name it (a
        dead letter would fail to publish, every time)."""
        name = self.dead_letter_queue or queue + DEAD_LETTER_SUFFIX
        if len(name.encode()) > MAX_NAME_BYTES:
            raise ConfigurationError(
                f"the dead-letter queue of {queue[:40]!r}... would be {len(name.encode())} bytes "
                f"long, AMQP's limit is {MAX_NAME_BYTES}: set RabbitConfig(dead_letter_queue=...)"
            )
        return name

    def dlq(self, queue: str) -> str:
        """Deprecated: ``dead_letters_of``, the name KafkaConfig has too."""
        warnings.warn(
            "RabbitConfig.dlq() is deprecated: use dead_letters_of()", DeprecationWarning, 2
        )
        return self.dead_letters_of(queue)
