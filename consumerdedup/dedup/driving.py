"""How every runner hands deliveries to a handler, whatever the handler's kind.

A runner turns each delivery into a Message and a refusal (None when the
delivery is usable). A refused delivery, or a message whose id cannot be a
dedup key, never reaches the pipeline: it is FAILED through the handler's
``refuse``, so the log, the counters and the dead-letter hook hear of it with
the reason the runner dead-letters it with. The rest go to ``process_batch``
as one batch, first: on an ordered source a refusal behind the first RETRY is
RETRY too, as the pipeline holds back what is behind a retried message. A
blocking runner drives an asyncio handler on an event loop of its own
(BlockingDriver); an asyncio runner drives a blocking handler in a worker
thread (AsyncDriver).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from ..errors import ConfigurationError, HeldBack, InvalidMessage
from ..message import Message, validate_id
from ..outcome import Outcome, Result
from .async_deduplicator import AsyncDedupHandler
from .deduplicator import DedupHandler

Handler = DedupHandler | AsyncDedupHandler
Delivered = tuple[Message, str | None]
"""A delivery's Message, and why it must be refused (None: it need not)."""

T = TypeVar("T")


def checked(handler: object) -> Handler:
    """``handler`` if it is what ``@dedup.handler`` returns, of either deduplicator."""
    if not isinstance(handler, DedupHandler | AsyncDedupHandler):
        raise ConfigurationError("handler must be what @dedup.handler returned")
    return handler


def refusal(message: Message, why: str | None) -> InvalidMessage | None:
    """Why ``message`` cannot go through the pipeline: the runner's reason, or its id's."""
    if why is not None:
        return InvalidMessage(why)
    try:
        validate_id(message.id)
    except InvalidMessage as exc:
        return exc
    return None


Refusal = tuple[Message, InvalidMessage]


def split(delivered: Sequence[Delivered]) -> tuple[list[Refusal | None], list[Message]]:
    """Each delivery's refusal (None where it is usable), and the usable messages in order."""
    refusals: list[Refusal | None] = []
    messages: list[Message] = []
    for message, why in delivered:
        error = refusal(message, why)
        refusals.append(None if error is None else (message, error))
        if error is None:
            messages.append(message)
    return refusals, messages


def held_back(
    refusals: Sequence[Refusal | None], processed: Sequence[Result], ordered: bool
) -> list[Refusal | Result | None]:
    """On an ordered source, a refusal behind the first RETRY is RETRY too (HeldBack).

    It is read again after that RETRY: refused now, it would be dead-lettered (and
    counted) again on every re-read.
    """
    if not ordered:
        return list(refusals)
    slots: list[Refusal | Result | None] = []
    results = iter(processed)
    ahead: Message | None = None  # the first message to retry
    for refusal in refusals:
        if refusal is None:
            result = next(results)
            if ahead is None and result.outcome is Outcome.RETRY:
                ahead = result.message
            slots.append(None)
        elif ahead is not None:
            why = HeldBack(f"behind {ahead.id!r}, which is retried")
            slots.append(Result(refusal[0], Outcome.RETRY, why))
        else:
            slots.append(refusal)
    return slots


def merged(refused: Sequence[Result | None], processed: Iterator[Result]) -> list[Result]:
    """The refusals' Results where they stand, the batch's Results in the other slots."""
    return [result if result is not None else next(processed) for result in refused]


class BlockingDriver:
    """Drives a handler of either kind from blocking code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer
        self._loop: asyncio.AbstractEventLoop | None = None

    def process(self, delivered: Sequence[Delivered], *, ordered: bool = False) -> list[Result]:
        """One Result per delivery, in order: the refused ones FAILED, the rest one batch."""
        refusals, messages = split(delivered)
        processed = self._batch(messages, ordered) if messages else []
        refused = [self._settle(slot) for slot in held_back(refusals, processed, ordered)]
        return merged(refused, iter(processed))

    def close(self) -> None:
        """Close the event loop an asyncio handler ran on, if any."""
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def _settle(self, slot: Refusal | Result | None) -> Result | None:
        if slot is None or isinstance(slot, Result):
            if slot is not None:
                self.handler.dedup.account(slot)
            return slot
        if isinstance(self.handler, AsyncDedupHandler):
            return self._run(self.handler.refuse(*slot))
        return self.handler.refuse(*slot)

    def _batch(self, messages: list[Message], ordered: bool) -> list[Result]:
        if isinstance(self.handler, AsyncDedupHandler):
            return self._run(self.handler.process_batch(messages, ordered=ordered))
        return self.handler.process_batch(messages, ordered=ordered)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)


class AsyncDriver:
    """Drives a handler of either kind from asyncio code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer

    async def process(
        self, delivered: Sequence[Delivered], *, ordered: bool = False
    ) -> list[Result]:
        """One Result per delivery, in order: the refused ones FAILED, the rest one batch."""
        refusals, messages = split(delivered)
        processed = await self._batch(messages, ordered) if messages else []
        refused = [await self._settle(slot) for slot in held_back(refusals, processed, ordered)]
        return merged(refused, iter(processed))

    async def _settle(self, slot: Refusal | Result | None) -> Result | None:
        if slot is None or isinstance(slot, Result):
            if slot is not None:
                self.handler.dedup.account(slot)
            return slot
        if isinstance(self.handler, AsyncDedupHandler):
            return await self.handler.refuse(*slot)
        return await asyncio.to_thread(self.handler.refuse, *slot)

    async def _batch(self, messages: list[Message], ordered: bool) -> list[Result]:
        if isinstance(self.handler, AsyncDedupHandler):
            return await self.handler.process_batch(messages, ordered=ordered)
        return await asyncio.to_thread(self.handler.process_batch, messages, ordered=ordered)
