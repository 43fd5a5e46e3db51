"""What the outbox relay publishes through: a Publisher, blocking or asyncio.

Contract (each sentence has a scenario in tests/contracts/publisher.py, which
MemoryBroker, RabbitPublisher and KafkaPublisher all pass):
- ``publish`` returns only once the broker has the message (acks, publisher
  confirms): a consumer can read it as soon as ``publish`` returned.
- The message keeps its body and headers; its ``event_id`` header is its id,
  and a broker with a message-id field of its own (AMQP ``message_id``) carries
  the same value there.
- Messages with the same key, published one after the other, arrive in that order.
- Its errors say whose fault a failure is. BrokerUnavailable (or any
  ConnectionError or TimeoutError): the broker is away, nothing is wrong with
  the event, so the relay ends the round, charges no attempt and backs off.
  DestinationMissing: the broker answers but the topic, exchange or queue does
  not exist, so the relay charges that event an attempt and backs it off,
  holding back only its key; other keys go in the same round. Any other error
  is charged the same way.
- It is a context manager (``with``; ``async with`` for an AsyncPublisher):
  leaving it closes what publishing opened, and a closed publisher opens again
  on its next ``publish``.
- It is blocking (``Publisher``) or asyncio (``AsyncPublisher``, whose
  ``publish`` and context are awaited); the relay runs either, an asyncio one
  on an event loop of its own.

Subclass the protocol to get the context-manager methods for free when there
is nothing to open or close.

Pipelining (optional): a publisher that also has ``publish_window`` (the
``WindowPublisher`` / ``AsyncWindowPublisher`` protocols) is given a window of
messages at a time: it sends them all, then waits for their confirmations
together, and returns one outcome per message, in order: None (confirmed), or
the error that message met (the same errors ``publish`` raises). Messages with
the same key go to the broker in window order. A publisher without it is
driven one ``publish`` at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NamedTuple, Protocol, Self, runtime_checkable


class Outgoing(NamedTuple):
    """One message of a window: ``publish``'s arguments."""

    destination: str
    body: bytes
    key: str | None
    headers: Mapping[str, str]


class NotSent(Exception):
    """A window's outcome for a message the publisher did not send (an older message of
    its key failed first, or the round ended): the relay neither marks nor charges it."""


Outcomes = list[BaseException | None]
"""One per message of a window, in order: None when the broker confirmed it."""


@runtime_checkable
class Publisher(Protocol):
    """A blocking publisher: ``publish`` waits for the broker's confirmation."""

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send one message and wait for the broker's confirmation."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close what publishing opened; the next ``publish`` opens it again."""
        return None


@runtime_checkable
class AsyncPublisher(Protocol):
    """An asyncio publisher: ``await publish(...)`` returns once the broker confirmed."""

    async def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Send one message and wait for the broker's confirmation."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Close what publishing opened; the next ``publish`` opens it again."""
        return None


@runtime_checkable
class WindowPublisher(Protocol):
    """A blocking publisher that pipelines: sends a window, then waits for every confirm."""

    def publish_window(self, messages: Sequence[Outgoing]) -> Outcomes:
        """Send every message, wait for their confirms together; one outcome per message."""
        ...


@runtime_checkable
class AsyncWindowPublisher(Protocol):
    """``WindowPublisher`` for asyncio: ``await publish_window(...)``."""

    async def publish_window(self, messages: Sequence[Outgoing]) -> Outcomes:
        """Send every message, wait for their confirms together; one outcome per message."""
        ...
