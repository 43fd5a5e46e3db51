"""RabbitConfig: how a RabbitConsumerRunner consumes one queue."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError, Message, options
from consumerdedup.headers import DEAD_LETTER_SUFFIX, ID_HEADER
from consumerdedup.options import settle
from consumerdedup.retry import Backoff

DEFAULT_URL = "amqp://guest:guest@localhost:5672/%2F"
TTL_ARGUMENT = "x-message-ttl"
MAX_MESSAGE_TTL = timedelta(days=3650)
"""The longest x-message-ttl RabbitMQ takes (measured: 315,360,000,000 ms; one more is
PRECONDITION_FAILED value_too_large)."""
MAX_NAME_BYTES = 255
"""AMQP short strings: queue names and routing keys (UTF-8 bytes)."""
EXCHANGE_NAME = re.compile(r"[a-zA-Z0-9_.:-]{0,255}")
EXCHANGE_RULE = (
    "an exchange name of a-z A-Z 0-9 - _ . : (AMQP 0-9-1), at most 255; '' is the default"
)
RESERVED = "amq."
OWN_ARGUMENTS = frozenset({"x-dead-letter-exchange", "x-dead-letter-routing-key"})
CONNECTION_OPTIONS = frozenset(
    name
    for name in dir(pika.ConnectionParameters)
    if isinstance(getattr(pika.ConnectionParameters, name), property)
)
"""What ``connection_options`` may set: pika ConnectionParameters' attributes."""


def connection_options(given: object, option: str) -> dict[str, Any]:
    """pika ConnectionParameters attributes, each value tried on a probe: a value pika refuses
    is said here, at construction, not at the first connection."""
    found = options.mapping(
        given,
        option,
        allowed=CONNECTION_OPTIONS,
        allowed_are="a pika ConnectionParameters attribute",
    )
    probe = pika.ConnectionParameters()
    for name, value in found.items():
        secret = name in ("credentials", "ssl_options")
        try:
            setattr(probe, name, value)
        except (TypeError, ValueError) as exc:
            raise options.refuse(
                f"{option}[{name!r}]",
                value,
                "a value pika takes" + ("" if secret else f" ({exc})"),  # pika quotes it
                secret=secret,
            ) from None
    return found


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
    """Extra ``queue_declare`` arguments when ``declare`` (``{"x-queue-type": "quorum"}``);
    not the dead-letter ones (``dead_letter_exchange`` and ``dead_letter_queue`` set those)."""
    message_ttl: timedelta | None = None
    """With ``declare``: the queue's message TTL (``x-message-ttl``, whole milliseconds, from
    a second to 3650 days). A message not consumed within it is dead-lettered by the broker; it is
    also how long a delivery can come again, so ``consumerdedup prune --rabbitmq`` reads it
    as the queue's consumers' window. None: no TTL (prune then needs ``--retention``). An
    existing queue keeps the arguments it was declared with: add a TTL to one with a policy
    (``message-ttl``), which prune reads too."""
    dead_letter_exchange: str = ""
    """Where dead letters are published; "" is the default exchange (routes by queue name).
    AMQP's characters (a-z A-Z 0-9 - _ . :); not ``amq.*`` with ``declare`` (reserved)."""
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
    """With ``run(until_idle=True)``: return once no delivery came for this long (> 0)."""
    connection_name: str | None = None
    """Client-provided connection name shown by the broker; None: one is made up."""
    connection_options: Mapping[str, Any] = field(default_factory=dict)
    """pika ConnectionParameters attributes set over the URL's (``{"heartbeat": 30}``)."""

    def __post_init__(self) -> None:
        option = "RabbitConfig."
        prefetch = options.integer(self.prefetch, option + "prefetch", at_least=1, at_most=65535)
        size = options.integer(self.batch_size, option + "batch_size", at_least=1, at_most=prefetch)
        settle(self, "batch_size", size)
        options.text(self.id_header, option + "id_header")
        options.maybe(self.key, option + "key", options.function, "a callable taking a Message")
        settle(self, "declare", options.boolean(self.declare, option + "declare"))
        self._check_dead_letters()
        arguments = options.mapping(self.queue_arguments, option + "queue_arguments")
        for ours in sorted(OWN_ARGUMENTS.intersection(arguments)):
            raise options.refuse(
                f"{option}queue_arguments key",
                ours,
                "no dead-letter argument: those are dead_letter_exchange's and dead_letter_queue's",
            )
        settle(self, "queue_arguments", arguments)
        for name in ("retry_delay", "reconnect_delay"):
            settle(self, name, options.duration(getattr(self, name), option + name, zero=True))
        for name, first in (
            ("max_retry_delay", self.retry_delay),
            ("max_reconnect_delay", self.reconnect_delay),
        ):
            settle(self, name, options.duration(getattr(self, name), option + name, at_least=first))
        options.maybe(self.reconnect_timeout, option + "reconnect_timeout", options.duration)
        settle(self, "idle_timeout", options.duration(self.idle_timeout, option + "idle_timeout"))
        options.maybe(self.connection_name, option + "connection_name", options.text)
        settle(
            self,
            "connection_options",
            connection_options(self.connection_options, option + "connection_options"),
        )
        self._check_message_ttl()

    def _check_message_ttl(self) -> None:
        option = "RabbitConfig.message_ttl"
        ttl = options.maybe(
            self.message_ttl, option, options.duration, at_least=timedelta(seconds=1),
            at_most=MAX_MESSAGE_TTL,
        )  # fmt: skip
        if ttl is not None and ttl % timedelta(milliseconds=1):
            raise options.refuse(option, ttl, "whole milliseconds (x-message-ttl is an integer)")
        if ttl is not None and TTL_ARGUMENT in self.queue_arguments:
            raise ConfigurationError(
                f"{option} and queue_arguments[{TTL_ARGUMENT!r}] both set the TTL: give one"
            )

    def _check_dead_letters(self) -> None:
        """Names AMQP can carry and the broker lets us declare: a dead letter that cannot be
        published fails every FAILED message, for good."""
        option = "RabbitConfig.dead_letter_exchange"
        exchange = options.matching(self.dead_letter_exchange, option, EXCHANGE_NAME, EXCHANGE_RULE)
        if self.declare and exchange.startswith(RESERVED):
            raise options.refuse(
                option,
                exchange,
                f"a name not starting {RESERVED!r} with declare=True (the broker reserves those)",
            )
        queue = options.maybe(
            self.dead_letter_queue, "RabbitConfig.dead_letter_queue", options.text
        )
        if queue is not None and len(queue.encode()) > MAX_NAME_BYTES:
            raise options.refuse(
                "RabbitConfig.dead_letter_queue", queue, f"at most {MAX_NAME_BYTES} bytes"
            )

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
