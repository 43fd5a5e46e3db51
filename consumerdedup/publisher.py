"""What the outbox relay publishes through: any broker client with one method.

Contract:
- ``publish`` returns only once the broker has confirmed the message (acks,
  publisher confirms); it raises if the broker refused or could not be reached.
- The message's ``headers`` carry its ``event_id``, and a publisher that has a
  native message-id field (AMQP ``message_id``) sets it to the same value.
- A publisher may be blocking or asyncio (``async def publish``); the relay
  runs either.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping
from typing import Protocol, runtime_checkable


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
