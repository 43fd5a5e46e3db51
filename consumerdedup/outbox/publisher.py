"""What the outbox relay publishes through: any broker client with one method.

Contract:
- ``publish`` returns only once the broker has confirmed the message (acks,
  publisher confirms); it raises if the broker refused or could not be reached.
- The message's ``headers`` carry its ``event_id``, and a publisher that has a
  native message-id field (AMQP ``message_id``) sets it to the same value.
- A publisher may be blocking or asyncio (``async def publish``); the relay
  runs either.
- Its errors say whose fault a failure is. BrokerUnavailable (or any
  ConnectionError or TimeoutError): the broker is away, nothing is wrong with
  the event, so the relay ends the round, charges no attempt and backs off.
  DestinationMissing: the broker answers but the topic, exchange or queue does
  not exist, so the relay charges that event an attempt and backs it off,
  holding back only its key; other keys go in the same round. Any other error
  is charged the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Protocol, runtime_checkable

from ..errors import ConsumerDedupError


class BrokerUnavailable(ConsumerDedupError, ConnectionError):
    """The broker cannot be reached or did not answer in time: transient, charged to no event."""


class DestinationMissing(ConsumerDedupError):
    """The broker answered: this destination does not exist (and it does not create it).

    Not a BrokerUnavailable even when the client library calls it retriable:
    one event's topic must not stop the events of every other key.
    """


@runtime_checkable
class Publisher(Protocol):
    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Awaitable[None] | None:
        """Send one message and wait for the broker's confirmation."""
