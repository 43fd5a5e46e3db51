"""What a published message becomes on AMQP: an exchange, a routing key, properties; and
what the broker's refusal of one means."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pika  # type: ignore[import-untyped]

from consumerdedup import InvalidMessage
from consumerdedup.headers import ID_HEADER
from consumerdedup.outbox.publisher import NotSent, Outgoing

from .connection import header_frame_size
from .errors import ExchangeMissing, PublishFailed, PublishRefused

PERSISTENT = pika.DeliveryMode.Persistent.value
Prepared = tuple[str, str, bytes, Any]
"""(exchange, routing key, body, properties) of one message."""


def route(destination: str, key: str | None = None) -> tuple[str, str]:
    """(exchange, routing key) of a destination.

    ``"orders"``: the default exchange, so straight to the queue ``orders``;
    ``"events/order.created"``: exchange ``events``, that routing key;
    ``"events/"``: exchange ``events`` with ``key`` as the routing key.
    """
    if not isinstance(destination, str) or not destination:
        raise InvalidMessage("destination must be a queue name or 'exchange/routing_key'")
    exchange, slash, routing_key = destination.partition("/")
    if not slash:
        return "", destination
    return exchange, routing_key or key or ""


def prepare(
    destination: str, key: str | None, headers: Mapping[str, str] | None
) -> tuple[str, str, Any]:
    """(exchange, routing key, properties) of a message; InvalidMessage without an event_id
    that AMQP's message_id can carry."""
    exchange, routing_key = route(destination, key)
    headers = dict(headers or {})
    event_id = headers.get(ID_HEADER)
    if not isinstance(event_id, str) or not 0 < len(event_id.encode()) <= 255:
        raise InvalidMessage(
            f"the {ID_HEADER!r} header must be a str of 1..255 bytes (AMQP message_id), "
            f"got {event_id!r}: consumers need it to deduplicate"
        )
    properties = pika.BasicProperties(
        message_id=event_id, headers=headers, delivery_mode=PERSISTENT
    )
    return exchange, routing_key, properties


def check_frame(exchange: str, properties: Any, limit: int) -> None:
    if header_frame_size(properties) > limit:
        # The broker would close the connection (501 FRAME_ERROR): taken for an outage,
        # this event would hold the relay's every round, and every key behind it.
        raise PublishRefused(
            f"cannot publish to {exchange!r}: the message's properties and headers "
            "exceed the connection's frame size (frame_max)"
        )


def surely_fits(properties: Any, limit: int) -> bool:
    """The header frame of ``properties`` (as ``prepare`` makes them) is certainly within
    ``limit``, by an upper bound of its size that encodes nothing: a str at most 4 bytes
    a character; a table entry's name, type and length 6 bytes more; 128 for the frame,
    the flags, delivery_mode and the message_id's length. False: encode to know."""
    headers = properties.headers or {}
    size = 128 + 4 * len(properties.message_id or "")
    for name, value in headers.items():
        if type(value) is not str:
            return False
        size += 6 + 4 * (len(name) + len(value))
    return size <= limit


def fits(message: Prepared | BaseException, limit: int) -> Prepared | BaseException:
    if isinstance(message, BaseException) or surely_fits(message[3], limit):
        return message
    try:
        check_frame(message[0], message[3], limit)
    except PublishRefused as exc:
        return exc
    return message


REFUSED_FOR_GOOD = {403, 406}
"""Channel errors that refuse the message itself: ACCESS_REFUSED (no write right to the
exchange), PRECONDITION_FAILED (over the broker's max_message_size, a bad property)."""


def channel_closed(exc: Any, exchange: str) -> PublishFailed:
    """Our error for a publish on which the broker closed the channel: the exchange missing
    (404, it may appear), refused for good (REFUSED_FOR_GOOD), or some other refusal."""
    if exc.reply_code == 404:
        return ExchangeMissing(f"{exchange!r}: {exc.reply_text}")
    kind = PublishRefused if exc.reply_code in REFUSED_FOR_GOOD else PublishFailed
    return kind(f"{exchange!r}: {exc.reply_code} {exc.reply_text}")


def held_back(
    messages: Sequence[Outgoing], window: list[Prepared | BaseException]
) -> list[Prepared | BaseException]:
    """After a message that cannot be sent, its key's later messages wait (NotSent)."""
    failed_keys: set[str] = set()
    for index, (message, entry) in enumerate(zip(messages, window, strict=True)):
        if message.key is None:
            continue
        if message.key in failed_keys:
            window[index] = NotSent()
        elif isinstance(entry, BaseException):
            failed_keys.add(message.key)
    return window
