"""``process_once``: one message of a hand-written loop through the runners' own pipeline.

For loops the library does not run (a confluent-kafka ``poll()`` loop, a dramatiq or
taskiq actor): the loop turns its delivery into a Message and asks for its Outcome. The
message goes through the very processor every runner uses (dedup.processing): the same
claim, guard, retries, FAILED records, dead-letter callback, circuit breaker and telemetry.
What the loop does with the Outcome is the loop's part, as a runner's is:

* PROCESSED, DUPLICATE, FAILED (recorded; the Deduplicator's ``dead_letter`` was called):
  acknowledge (commit the offset, return from the actor);
* RETRY (nothing recorded): do not acknowledge; deliver it again (seek back, raise).

Built once per loop (``once = process_once(handler)``), not per message: the startup
check runs on the first message and the circuit breaker counts across messages; once the
breaker is open a call raises ``CircuitOpen`` and the loop should stop.
"""

from __future__ import annotations

from ..breaker import CircuitBreaker
from ..dedup.processing import AsyncProcessor, BlockingProcessor, Handler
from ..message import Message
from ..options import instance
from ..outcome import Result

__all__ = ["AsyncProcessOnce", "ProcessOnce", "process_once", "process_once_async"]

_MESSAGE = "a consumerdedup.Message"


class ProcessOnce:
    """Decides one message at a time from blocking code; ``handler`` is what
    ``@dedup.handler`` (or ``bulk_handler``) returned, of either deduplicator."""

    def __init__(self, handler: Handler) -> None:
        self._processor = BlockingProcessor(handler)

    @property
    def breaker(self) -> CircuitBreaker:
        """The loop's circuit breaker (consumerdedup.breaker): ``open`` once tripped."""
        return self._processor.breaker

    def __call__(self, message: Message) -> Result:
        """The message's Result (outcome, error, attempts); ``CircuitOpen`` if the breaker
        opened on an earlier message (the message is not tried: stop the loop)."""
        instance(message, "process_once(message)", Message, _MESSAGE)
        self._processor.check_startup()
        self.breaker.raise_if_open()
        [result] = self._processor.process([(message, None)])
        return result

    def close(self) -> None:
        """Close the event loop an asyncio handler ran on, if any."""
        self._processor.close()

    def __enter__(self) -> ProcessOnce:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncProcessOnce:
    """``ProcessOnce`` for asyncio code (a blocking handler runs in a worker thread)."""

    def __init__(self, handler: Handler) -> None:
        self._processor = AsyncProcessor(handler)

    @property
    def breaker(self) -> CircuitBreaker:
        """The loop's circuit breaker (consumerdedup.breaker): ``open`` once tripped."""
        return self._processor.breaker

    async def __call__(self, message: Message) -> Result:
        """``ProcessOnce.__call__`` from asyncio code."""
        instance(message, "process_once(message)", Message, _MESSAGE)
        await self._processor.check_startup()
        self.breaker.raise_if_open()
        [result] = await self._processor.process([(message, None)])
        return result


def process_once(handler: Handler) -> ProcessOnce:
    """``once = process_once(handler)`` before the loop; ``once(message)`` -> Result in it."""
    return ProcessOnce(handler)


def process_once_async(handler: Handler) -> AsyncProcessOnce:
    """``process_once`` for asyncio loops: ``await once(message)`` -> Result."""
    return AsyncProcessOnce(handler)
