"""RabbitPublisher: confirmed, persistent, mandatory publishing for the outbox relay."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]
import tenacity

from consumerdedup import InvalidMessage, options
from consumerdedup.outbox.publisher import NotSent, Outgoing, Publisher
from consumerdedup.retry import Backoff

from .config import DEFAULT_URL
from .config import connection_options as checked_connection_options
from .confirms import ConfirmWindow, Unresolved
from .connection import close_quietly, connect, frame_max, losses_handled, parameters
from .errors import (
    BrokerUnavailable,
    PublishFailed,
    PublishNacked,
    Unroutable,
)
from .keepalive import KeepAlive
from .outgoing import Prepared, channel_closed, check_frame, fits, held_back, prepare

log = logging.getLogger("consumerdedup.rabbitmq")
_names = itertools.count(1)
BACKOFF = Backoff(timedelta(milliseconds=100), timedelta(seconds=2))
"""Between connection attempts, and before sending again on a new connection."""


class RabbitPublisher(Publisher):
    """consumerdedup's Publisher on RabbitMQ: confirms on, ``delivery_mode`` persistent,
    ``mandatory``, ``message_id`` = the ``event_id`` header. Thread-safe (calls are serialized).

    An unroutable message raises Unroutable, a missing exchange ExchangeMissing
    (both DestinationMissing), a refused one PublishNacked; a lost connection is reopened
    and the message sent again, up to ``attempts`` times, then BrokerUnavailable (a
    ConnectionError: transient).
    Connecting is retried with backoff for up to ``connect_timeout``.
    Between publishes a thread answers the broker's heartbeats (``keepalive``), so an idle
    relay keeps its connection; one lost anyway is said in one WARNING line and reopened
    at the next publish, pika's own lines about it kept to DEBUG.
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
        option = "RabbitPublisher."
        options.text(url, option + "url", secret=True)
        self.attempts = options.integer(attempts, option + "attempts", at_least=1)
        self.connect_timeout = options.duration(connect_timeout, option + "connect_timeout")
        self.confirm_timeout = options.duration(confirm_timeout, option + "confirm_timeout")
        options.maybe(connection_name, option + "connection_name", options.text)
        connection_options = options.maybe(
            connection_options, option + "connection_options", checked_connection_options
        )
        self.name = connection_name or f"consumerdedup-publisher:{os.getpid()}:{next(_names)}"
        self._params = parameters(url, connection_options or {}, self.name)
        self._lock = threading.Lock()
        self._connection: Any = None
        self._channel: Any = None  # confirms one at a time (publish)
        self._window: ConfirmWindow | None = None  # pipelined confirms (publish_window)
        self._keepalive = KeepAlive(self._lock, self._lost)  # heartbeats between publishes
        self._opened = False
        self.reconnects = 0
        """Connections opened after the first (each follows a lost or dropped one)."""

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Publish one message and wait for the broker's confirm."""
        exchange, routing_key, properties = prepare(destination, key, headers)
        with self._lock, losses_handled():
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
        with self._lock, losses_handled():
            try:
                confirms = self._confirm_window()
                limit = frame_max(self._connection, self._params)
            except pika.exceptions.AMQPConnectionError as exc:
                self._lost(exc)
                lost = BrokerUnavailable(f"lost RabbitMQ while publishing: {exc!r}")
                return [lost] * len(messages)
            window = held_back(messages, [fits(m, limit) for m in window])
            outcomes = confirms.send(window, ids)
            if not confirms.usable:
                self._window = None
            if isinstance(confirms.closed, pika.exceptions.AMQPConnectionError | TimeoutError):
                self._lost(confirms.closed)
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
        except pika.exceptions.AMQPConnectionError as exc:
            self._lost(exc)
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
        if self._opened:
            self.reconnects += 1
        self._opened = True
        self._keepalive.watch(self._connection)

    def _lost(self, error: BaseException) -> None:
        """The connection is gone (or no longer trusted): one line, then it is dropped and
        the next publish opens another."""
        if self._connection is not None:
            log.warning("%s lost its RabbitMQ connection (%r); reconnecting", self.name, error)
        self._drop()

    def _drop(self) -> None:
        self._keepalive.forget()
        close_quietly(self._connection)
        self._connection = self._channel = self._window = None

    def close(self) -> None:
        with self._lock, losses_handled():
            self._drop()

    def __enter__(self) -> RabbitPublisher:
        """Connect now: a broker that refuses us (BrokerRefused, a ConfigurationError) or is
        away (BrokerUnavailable) is said here, before the relay claims any event."""
        with self._lock, losses_handled():
            if self._channel is None or not self._channel.is_open:
                self._open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
