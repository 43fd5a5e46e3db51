"""RabbitPublisher: confirmed, persistent, mandatory publishing for the outbox relay."""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]
import tenacity

from consumerdedup import ConfigurationError, InvalidMessage
from consumerdedup.outbox.publisher import NotSent, Outgoing, Publisher
from consumerdedup.retry import Backoff

from .config import DEFAULT_URL
from .confirms import ConfirmWindow, Unresolved
from .connection import close_quietly, connect, frame_max, parameters
from .errors import (
    BrokerUnavailable,
    ExchangeMissing,
    PublishFailed,
    PublishNacked,
    PublishRefused,
    Unroutable,
)
from .outgoing import Prepared, check_frame, fits, prepare

_names = itertools.count(1)
BACKOFF = Backoff(timedelta(milliseconds=100), timedelta(seconds=2))
"""Between connection attempts, and before sending again on a new connection."""


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


def _held_back(
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
        confirm_timeout: timedelta = timedelta(seconds=30),
        connection_name: str | None = None,
        connection_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"attempts must be an int >= 1, got {attempts!r}")
        if connect_timeout <= timedelta(0) or confirm_timeout <= timedelta(0):
            raise ConfigurationError("connect_timeout and confirm_timeout must be positive")
        self.attempts = attempts
        self.connect_timeout = connect_timeout
        self.confirm_timeout = confirm_timeout
        self.name = connection_name or f"consumerdedup-publisher:{os.getpid()}:{next(_names)}"
        self._params = parameters(url, connection_options or {}, self.name)
        self._lock = threading.Lock()
        self._connection: Any = None
        self._channel: Any = None  # confirms one at a time (publish)
        self._window: ConfirmWindow | None = None  # pipelined confirms (publish_window)

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Publish one message and wait for the broker's confirm."""
        exchange, routing_key, properties = prepare(destination, key, headers)
        with self._lock:
            self._publish_one(destination, exchange, routing_key, body, properties)

    def publish_window(self, messages: Sequence[Outgoing]) -> list[BaseException | None]:
        """Publish every message back to back, then wait for their confirms together.

        A lost connection makes the unconfirmed ones BrokerUnavailable (the relay sends
        them again next round). When the broker closes the channel under the window (a
        missing exchange, a refused message), the unconfirmed ones go again one at a time
        with a confirm each, which names the culprit; after a failure, later messages of
        its key are NotSent.
        """
        window: list[Prepared | BaseException] = []
        for message in messages:
            try:
                exchange, routing_key, properties = prepare(
                    message.destination, message.key, message.headers
                )
                window.append((exchange, routing_key, message.body, properties))
            except InvalidMessage as exc:
                window.append(exc)
        ids = [m[3].message_id if isinstance(m, tuple) else "" for m in window]
        with self._lock:
            try:
                confirms = self._confirm_window()
                limit = frame_max(self._connection, self._params)
            except pika.exceptions.AMQPConnectionError as exc:
                self._drop()
                lost = BrokerUnavailable(f"lost RabbitMQ while publishing: {exc!r}")
                return [lost] * len(messages)
            window = _held_back(messages, [fits(m, limit) for m in window])
            outcomes = confirms.send(window, ids)
            if not confirms.usable:
                self._window = None
            if isinstance(confirms.closed, pika.exceptions.AMQPConnectionError | TimeoutError):
                self._drop()
            return self._settle_unresolved(messages, window, outcomes)

    def _settle_unresolved(
        self,
        messages: Sequence[Outgoing],
        window: list[Prepared | BaseException],
        outcomes: list[BaseException | None],
    ) -> list[BaseException | None]:
        """Send again, one at a time and in order, what the window left unconfirmed."""
        failed_keys: set[str] = set()
        for index, outcome in enumerate(outcomes):
            key = messages[index].key
            if isinstance(outcome, Unresolved):
                if key is not None and key in failed_keys:
                    outcomes[index] = NotSent()
                    continue
                exchange, routing_key, body, properties = window[index]  # type: ignore[misc]
                try:
                    self._publish_one(
                        messages[index].destination, exchange, routing_key, body, properties
                    )
                    outcomes[index] = None
                except Exception as exc:
                    outcomes[index] = exc
            if outcomes[index] is not None and key is not None:
                failed_keys.add(key)
        return outcomes

    def _confirm_window(self) -> ConfirmWindow:
        if self._channel is None or not self._channel.is_open:
            self._open()
        if self._window is None or not self._window.usable:
            self._window = ConfirmWindow(self._connection, self.confirm_timeout.total_seconds())
        return self._window

    def _publish_one(
        self, destination: str, exchange: str, routing_key: str, body: bytes, properties: Any
    ) -> None:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(pika.exceptions.AMQPConnectionError),
            stop=tenacity.stop_after_attempt(self.attempts),
            wait=BACKOFF,
            reraise=True,
        )
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
            check_frame(exchange, properties, frame_max(self._connection, self._params))
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
        self._connection = self._channel = self._window = None

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
