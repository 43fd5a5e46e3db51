"""A FastStream message as a consumerdedup Message, with an identity FastStream did not invent.

FastStream fills ``StreamMessage.message_id`` even when the producer set none: RabbitMQ
``message_id or gen_cor_id()`` (a fresh uuid per delivery), NATS a ``message_id`` header its
own publisher never sets (else a fresh uuid), Kafka ``offset-timestamp`` (no topic, no
partition: two partitions share it). A fresh id per delivery makes every redelivery look
new, and a shared one makes different messages look like twins, so that field is never
read here. The id comes from the broker's raw message, as the library's own runners take
it:

* RabbitMQ (aio-pika): the ``message_id`` property the producer set, else the
  ``id_header`` header (``event_id``, what the outbox sets), else ``key(message)``;
* Kafka (aiokafka): the ``id_header`` header, else ``topic:partition:offset``: the
  Kafka runner's ids (``kafka_records.kafka_message``), so both agree on every key;
* NATS: the ``Nats-Msg-Id`` header (JetStream's own dedup id), else ``id_header``, else
  ``key(message)``;
* Redis: the ``id_header`` header of FastStream's envelope, else a stream entry's
  ``stream:entry-id``, else ``key(message)`` (lists and channels have no id of their own);
* any other broker: ``key(message)`` only.

A delivery with none of these is refused (FAILED, InvalidMessage: dead-lettered), never
given a made-up id. The Message's ``raw`` is FastStream's StreamMessage. ``key`` is the
user's function of the Message (headers, body) for producers that put the id elsewhere;
it returns the id or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ..dedup.processing import Delivered
from ..errors import ConfigurationError
from ..message import Message
from ..reasons import describe
from .kafka_records import kafka_message

__all__ = ["NATS_ID_HEADER", "KeyFunction", "broker_of", "delivered"]

KeyFunction = Callable[[Message], str | None]
"""The user's id for a delivery whose broker carries none (None: it has none either)."""

NATS_ID_HEADER = "Nats-Msg-Id"
"""JetStream's deduplication header: the id a NATS producer sets for exactly this purpose."""


def _batch() -> ConfigurationError:
    return ConfigurationError(
        "consumerdedup.faststream: a batch subscriber is not supported (each message is its "
        "own transaction): subscribe without batch=True"
    )


def broker_of(stream_message: Any) -> str:
    """``rabbit``, ``kafka``, ``nats``, ``redis``...: FastStream's module of the message."""
    return str(type(stream_message).__module__).split(".")[1]


def delivered(stream_message: Any, id_header: str, key: KeyFunction | None) -> Delivered:
    """The Message of a FastStream delivery, and why it has no id (None when it has one)."""
    raw = stream_message.raw_message
    broker = broker_of(stream_message)
    if broker == "kafka":
        if isinstance(raw, tuple):
            raise _batch()
        return replace(kafka_message(raw, id_header=id_header), raw=stream_message), None
    if broker == "rabbit":
        headers = _texts(raw.headers or {})
        message = Message(
            id=raw.message_id or headers.get(id_header),
            body=raw.body,
            headers=headers,
            source=raw.routing_key or "",
            raw=stream_message,
        )
        missing = f"no message id: no message_id property and no {id_header!r} header"
    elif broker == "nats":
        headers = _texts(raw.headers or {})
        message = Message(
            id=headers.get(NATS_ID_HEADER) or headers.get(id_header),
            body=raw.data,
            headers=headers,
            source=raw.subject,
            raw=stream_message,
        )
        missing = f"no message id: no {NATS_ID_HEADER!r} and no {id_header!r} header"
    elif broker == "redis":
        return _redis(stream_message, id_header, key)
    else:
        headers = _texts(stream_message.headers or {})
        message = Message(id=None, body=stream_message.body, headers=headers, raw=stream_message)
        missing = f"no message id: FastStream's {broker} broker carries none of its own"
    return _keyed(message, missing, key)


def _redis(stream_message: Any, id_header: str, key: KeyFunction | None) -> Delivered:
    """Redis: the ``id_header`` of FastStream's envelope, else a stream entry's
    ``stream:entry-id`` (kept by a pending entry's redelivery); lists and channels have no
    id of their own (and no redelivery)."""
    if type(stream_message).__name__.startswith("RedisBatch"):
        raise _batch()
    raw = stream_message.raw_message
    source = _text(raw.get("channel"))
    headers = _texts(stream_message.headers or {})
    found = headers.get(id_header)
    entries = raw.get("message_ids")
    if found is None and entries:
        found = f"{source}:{_text(entries[0])}"
    message = Message(
        id=found, body=stream_message.body, headers=headers, source=source, raw=stream_message
    )
    missing = f"no message id: no {id_header!r} header and not a stream entry"
    return _keyed(message, missing, key)


def _text(value: Any) -> str:
    return (
        value.decode("utf-8", errors="backslashreplace") if isinstance(value, bytes) else str(value)
    )


def _keyed(message: Message, missing: str, key: KeyFunction | None) -> Delivered:
    if message.id is not None:
        return message, None
    if key is None:
        return message, f"{missing}, and no key function was given"
    try:
        found = key(message)
    except Exception as exc:  # a key function that cannot parse this body: refuse the message
        return message, f"{missing}, and the key function raised {describe(exc)}"
    if found is None:
        return message, f"{missing}, and the key function found none"
    return replace(message, id=found), None


def _texts(headers: Mapping[str, Any]) -> dict[str, str]:
    """Header values as text (bytes decoded, numbers written out), as handlers read them."""
    return {
        str(name): value.decode("utf-8", errors="backslashreplace")
        if isinstance(value, bytes)
        else str(value)
        for name, value in headers.items()
    }
