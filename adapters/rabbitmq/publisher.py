"""RabbitPublisher: confirmed, persistent, mandatory publishing for the outbox relay."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]
import tenacity

from consumerdedup import ConfigurationError, InvalidMessage
from consumerdedup.headers import ID_HEADER
from consumerdedup.outbox.publisher import Publisher
from consumerdedup.retry import Backoff

from .config import DEFAULT_URL
from .connection import close_quietly, connect, frame_max, header_frame_size, parameters
from .errors import (
    BrokerUnavailable,
    ExchangeMissing,
    PublishFailed,
    PublishNacked,
    PublishRefused,
    Unroutable,
)

_names = itertools.count(1)
PERSISTENT = pika.DeliveryMode.Persistent.value
BACKOFF = Backoff(timedelta(milliseconds=100), timedelta(seconds=2))
"""Between connection attempts, and before sending again on a new connection."""


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


class RabbitPublisher(Publisher):
    """consumerdedup's Publisher on RabbitMQ: confirms on, ``delivery_mode`` persistent,
    ``mandatory``, ``message_id`` = the ``event_id`` header. Thread-safe (calls are serialized).

    An unroutable message raises Unroutable, a missing exchange ExchangeMissing
    (both DestinationMissing), a refused one PublishNacked; a lost connection is reopened
    and the message sent again, up to ``attempts`` times, then BrokerUnavailable (a
    ConnectionError: transient).
    Connecting is retried with backoff for up to ``connect_timeout``.
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        attempts: int = 3,
        connect_timeout: timedelta = timedelta(seconds=10),
        connection_name: str | None = None,
        connection_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"attempts must be an int >= 1, got {attempts!r}")
        if connect_timeout <= timedelta(0):
            raise ConfigurationError("connect_timeout must be positive")
        self.attempts = attempts
        self.connect_timeout = connect_timeout
        self.name = connection_name or f"consumerdedup-publisher:{os.getpid()}:{next(_names)}"
        self._params = parameters(url, connection_options or {}, self.name)
        self._lock = threading.Lock()
        self._connection: Any = None
        self._channel: Any = None

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Publish one message and wait for the broker's confirm."""
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
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(pika.exceptions.AMQPConnectionError),
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=BACKOFF,
            reraise=True,
        )
        with self._lock:
            try:
                retrying(self._send, exchange, routing_key, body, properties)
            except pika.exceptions.UnroutableError as exc:
                raise Unroutable(
                    f"no queue is bound for exchange {exchange!r}, routing key {routing_key!r}"
                ) from exc
            except pika.exceptions.NackError as exc:
                raise PublishNacked(f"the broker refused a message to {destination!r}") from exc
            except pika.exceptions.AMQPConnectionError as exc:
                raise BrokerUnavailable(f"lost RabbitMQ while publishing: {exc!r}") from exc
            except pika.exceptions.AMQPError as exc:
                raise PublishFailed(f"cannot publish to {destination!r}: {exc!r}") from exc

    def _send(self, exchange: str, routing_key: str, body: bytes, properties: Any) -> None:
        try:
            if self._channel is None or not self._channel.is_open:
                self._open()
            if header_frame_size(properties) > frame_max(self._connection, self._params):
                # The broker would close the connection (501 FRAME_ERROR): taken for an outage,
                # this event would hold the relay's every round, and every key behind it.
                raise PublishRefused(
                    f"cannot publish to {exchange!r}: the message's properties and headers "
                    "exceed the connection's frame size (frame_max)"
                )
            self._channel.basic_publish(
                exchange, routing_key, body, properties=properties, mandatory=True
            )
        except pika.exceptions.AMQPConnectionError:
            self._drop()
            raise
        except pika.exceptions.ChannelClosedByBroker as exc:
            # A missing exchange (404) closes the channel: report it, reopen next time.
            self._channel = None
            raise channel_closed(exc, exchange) from exc

    def _open(self) -> None:
        self._drop()
        self._connection = connect(
            self._params,
            backoff=BACKOFF,
            give_up_after=self.connect_timeout,
            stopping=lambda: False,
            pause=time.sleep,
        )
        self._channel = self._connection.channel()
        self._channel.confirm_delivery()

    def _drop(self) -> None:
        close_quietly(self._connection)
        self._connection = self._channel = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> RabbitPublisher:
        """Connect now: a broker that refuses us (BrokerRefused, a ConfigurationError) or is
        away (BrokerUnavailable) is said here, before the relay claims any event."""
        with self._lock:
            if self._channel is None or not self._channel.is_open:
                self._open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
