"""Pipelined publishing on RabbitMQ: a window of messages sent back to back on a channel in
confirm mode, then their confirms awaited together.

pika's BlockingChannel in confirm mode waits for each message's confirm before the next
publish (one round trip, and on a durable queue one fsync, per message). Its underlying
channel (``BlockingChannel._impl``, pika.channel.Channel, the asynchronous adapters' own)
takes an ack/nack callback instead: confirms arrive by delivery tag, one ``multiple`` ack
confirming many, while the blocking connection's ``process_data_events`` drives the
socket. The window is published on that channel too: BlockingChannel.basic_publish runs
the I/O loop once per message to flush it (a poll and a send per frame), the underlying
one only buffers, and the window goes out in one go (a flush per ``FLUSH_BYTES``).
``mandatory`` returns arrive before their message's ack (the broker sends Basic.Return
first) and are matched to it by ``message_id`` (the event_id, unique).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import pika  # type: ignore[import-untyped]
import pika.exceptions  # type: ignore[import-untyped]

from .errors import BrokerUnavailable, PublishNacked, Unroutable
from .outgoing import Prepared

FLUSH_BYTES = 1 << 20
"""Bytes a window buffers before writing them out (and reading what came back)."""


class Unresolved(Exception):
    """No confirm came for this message: the channel closed under the window (a missing
    exchange, a refused message); the publisher sends it again one at a time."""


class ConfirmWindow:
    """A channel of ``connection`` in confirm mode with callbacks; ``send`` a window."""

    def __init__(self, connection: Any, timeout: float) -> None:
        self.connection = connection
        self.timeout = timeout
        self.channel = connection.channel()
        self._unconfirmed: dict[int, int] = {}  # delivery tag: index in the window
        self._outcomes: list[BaseException | None] = []
        self._ids: list[str] = []
        self._window: Sequence[Prepared | BaseException] = []
        self._returned: set[str] = set()
        self._next_tag = 1
        self.closed: BaseException | None = None
        channel = self.channel._impl  # callbacks fire in frame order, as frames arrive
        channel.add_on_return_callback(self._on_return)
        channel.add_on_close_callback(self._on_close)
        selected: list[object] = []

        def on_selected(frame: object) -> None:
            selected.append(frame)
            self._wake()

        channel.confirm_delivery(ack_nack_callback=self._on_confirm, callback=on_selected)
        self._wait(lambda: bool(selected), time.monotonic() + timeout)

    @property
    def usable(self) -> bool:
        return self.closed is None and self.channel.is_open

    def send(
        self, window: Sequence[Prepared | BaseException], ids: Sequence[str]
    ) -> list[BaseException | None]:
        """Publish every prepared message, then wait for all their confirms.

        An entry that is an error already is its own outcome. On a lost connection the
        unconfirmed messages are BrokerUnavailable; when the broker closes the channel they
        are Unresolved (the caller finds the culprit one at a time); with no confirm within
        ``timeout`` they are BrokerUnavailable.
        """
        pending = Unresolved("not confirmed")
        self._outcomes = [pending] * len(window)
        self._window = window
        self._ids, self._returned = list(ids), set()
        publish = self.channel._impl.basic_publish  # buffered: no flush per message
        buffered = self.connection._impl._get_write_buffer_size
        try:
            for index, message in enumerate(window):
                if isinstance(message, BaseException):
                    self._outcomes[index] = message
                    continue
                if self.closed is not None:
                    break
                exchange, routing_key, body, properties = message
                self._unconfirmed[self._next_tag] = index
                self._next_tag += 1
                publish(exchange, routing_key, body, properties, mandatory=True)
                if buffered() >= FLUSH_BYTES:
                    # A big window is written as it goes, not held whole in memory; the
                    # confirms and returns that came meanwhile are read too.
                    self.connection.process_data_events(time_limit=0)
            self._wait(
                lambda: not self._unconfirmed or self.closed is not None,
                time.monotonic() + self.timeout,
            )
        except (pika.exceptions.ChannelClosed, pika.exceptions.ChannelWrongStateError) as exc:
            self.closed = self.closed or exc
        except (pika.exceptions.AMQPConnectionError, TimeoutError) as exc:
            lost = BrokerUnavailable(f"lost RabbitMQ while waiting for confirms: {exc!r}")
            self._resolve_all(lost)
            self.closed = exc
        self._unconfirmed.clear()
        return self._outcomes

    def _resolve_all(self, error: BaseException) -> None:
        for index in self._unconfirmed.values():
            self._outcomes[index] = error
        self._unconfirmed.clear()

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if method.multiple:  # the dict holds tags in the order they were sent
            tags = list(itertools.takewhile(method.delivery_tag.__ge__, self._unconfirmed))
        else:
            tags = [method.delivery_tag]
        nacked = isinstance(method, pika.spec.Basic.Nack)
        outcomes, returned = self._outcomes, self._returned
        for tag in tags:
            index = self._unconfirmed.pop(tag, None)
            if index is None:
                continue  # a confirm for an earlier window that timed out
            if not nacked and not (returned and self._ids[index] in returned):
                outcomes[index] = None
                continue
            exchange, routing_key = self._window[index][:2]  # type: ignore[index]
            if nacked:
                outcomes[index] = PublishNacked(
                    f"the broker refused a message to exchange {exchange!r}, routing key "
                    f"{routing_key!r} (a full queue with overflow reject-publish, or a "
                    "broker error)"
                )
            else:
                outcomes[index] = Unroutable(
                    f"no queue is bound for exchange {exchange!r}, routing key {routing_key!r}"
                )
        if not self._unconfirmed:
            self._wake()

    def _on_return(self, _channel: Any, _method: Any, properties: Any, _body: bytes) -> None:
        self._returned.add(properties.message_id)

    def _on_close(self, _channel: Any, reason: BaseException) -> None:
        self.closed = reason
        self._wake()

    def _wake(self) -> None:
        """End the current ``process_data_events`` (it returns on a ready event). Not on a
        connection that is closing: it returns by itself then, and pika refuses the call
        (raised inside pika's own connection-lost handling, it was logged with a traceback)."""
        if self.connection.is_open:
            self.connection.add_callback_threadsafe(lambda: None)

    def _wait(self, done: Callable[[], bool], deadline: float) -> None:
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no publisher confirm within {self.timeout:g} s")
            self.connection.process_data_events(time_limit=left)
