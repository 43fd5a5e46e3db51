"""Deliveries to Messages, and the properties of a dead-letter copy."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, NamedTuple

import pika  # type: ignore[import-untyped]

from consumerdedup import Message
from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER, SOURCE_HEADER
from consumerdedup.reasons import REASON_LIMIT, describe

from .config import RabbitConfig

BODY_DROPPED_HEADER = "x-dead-letter-body-dropped"
"""On a dead letter sent without its body, because the broker refused the full copy for
good: why it refused it."""
_NO_HEADERS: MappingProxyType[str, str] = MappingProxyType({})
"""The headers of a delivery without any: one frozen empty table for all of them."""


class Delivery(NamedTuple):
    """One pika delivery, kept as ``Message.raw``.

    A NamedTuple: immutable like a frozen dataclass, and made in a fifth of the time (one is
    made per delivery, in pika's callback)."""

    method: Any  # pika.spec.Basic.Deliver: delivery_tag, redelivered, exchange, routing_key
    properties: Any  # pika.BasicProperties
    body: bytes

    @property
    def tag(self) -> int:
        return int(self.method.delivery_tag)


def to_message(delivery: Delivery, queue: str, config: RabbitConfig) -> tuple[Message, str | None]:
    """The Message of a delivery, and why it has no id (None when it has one).

    The id is the ``message_id`` property, else the ``config.id_header`` header,
    else what ``config.key`` returns; it is never made up.

    Never raises: a delivery this cannot read is refused with the reason (one delivery's
    conversion error raising here would stop the queue on every restart).
    """
    try:
        return _converted(delivery, queue, config)
    except Exception as exc:
        return unreadable(delivery, queue), f"the delivery cannot be read: {describe(exc)}"


def unreadable(delivery: Delivery, queue: str) -> Message:
    """A Message of what can surely be taken from ``delivery``: enough to dead-letter it."""
    body = delivery.body
    return Message(
        id=None, body=body if isinstance(body, bytes) else b"", source=queue, raw=delivery
    )


def _converted(delivery: Delivery, queue: str, config: RabbitConfig) -> tuple[Message, str | None]:
    props = delivery.properties
    raw_headers = props.headers or {}
    if not isinstance(raw_headers, dict):
        raise TypeError(f"the headers are a {type(raw_headers).__name__}, not a table")
    if not isinstance(delivery.body, bytes):
        raise TypeError(f"the body is a {type(delivery.body).__name__}, not bytes")
    # The message_id property, else the header passed as found (one that is not text, bytes
    # or a number, fails validation); the Message is made once, with its id.
    found_id = props.message_id if props.message_id else raw_headers.get(config.id_header)
    # Frozen here (a fresh dict, or none at all), so the Message does not copy them again.
    headers = (
        MappingProxyType({str(k): _text(v) for k, v in raw_headers.items()})
        if raw_headers
        else _NO_HEADERS
    )
    message = Message(
        id=found_id,
        body=delivery.body,
        headers=headers,
        source=queue,
        timestamp=_timestamp(props.timestamp) if props.timestamp else None,
        raw=delivery,
    )
    if found_id is not None:
        return message, None
    missing = f"no message id: no message_id property and no {config.id_header!r} header"
    if config.key is None:
        return message, missing
    try:
        found = config.key(message)
    except Exception as exc:  # a key function that cannot parse this body: refuse the message
        return message, f"{missing}, and the key function raised {describe(exc)}"
    if found is None:
        return message, f"{missing}, and the key function found none"
    return replace(message, id=found), None


def dead_letter_properties(
    delivery: Delivery, reason: str, consumer: str, queue: str
) -> pika.BasicProperties:
    """The original properties plus the reason headers, persistent, never expiring, without
    the original's user_id (the broker checks it against our connection's user)."""
    props = copy.copy(delivery.properties)
    headers = delivery.properties.headers
    props.headers = {
        **(headers if isinstance(headers, dict) else {}),
        REASON_HEADER: reason[:REASON_LIMIT],
        CONSUMER_HEADER: consumer,
        SOURCE_HEADER: queue,
    }
    props.delivery_mode = pika.DeliveryMode.Persistent.value
    props.expiration = None  # a per-message TTL would expire the dead letter too
    # RabbitMQ refuses a user_id other than the publishing connection's user (406): kept, a
    # message another user published with its own would never be dead-lettered.
    props.user_id = None
    return props


def _timestamp(seconds: Any) -> datetime | None:
    try:
        return datetime.fromtimestamp(seconds, UTC) if seconds else None
    except (OverflowError, OSError, ValueError, TypeError):  # a producer's nonsense: no time
        return None


def _text(value: Any) -> str:
    # pika gives text as str, and bytes only for what is not valid UTF-8.
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
