"""How every runner hands deliveries to a handler, whatever the handler's kind.

A runner turns each delivery into a Message and a refusal (None when the
delivery is usable) and hands them all, in order, to a processor: the handler's
``process_deliveries`` decides every one of them in one pipeline, the refused
ones included (FAILED with the runner's reason, or RETRY behind a RETRY on an
ordered source). A blocking runner drives an asyncio handler on an event loop
of its own (BlockingProcessor); an asyncio runner drives a blocking handler in
a worker thread (AsyncProcessor).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractContextManager

from ..breaker import CircuitBreaker
from ..event_loop import OwnLoop
from ..options import refuse
from ..outcome import Result
from ..startup import require_startup, require_startup_async
from ..telemetry import hooks
from .async_deduplicator import AsyncDedupHandler
from .deduplicator import DedupHandler
from .nesting import deciding
from .offset_fence import OffsetFence
from .pipeline import Delivered

Handler = DedupHandler | AsyncDedupHandler

__all__ = ["AsyncProcessor", "BlockingProcessor", "Delivered", "Handler", "checked"]


def breaker_of(handler: Handler) -> CircuitBreaker:
    """A new circuit breaker by the handler's RetryPolicy.breaker_threshold: one per runner."""
    return CircuitBreaker(handler.dedup.retry.breaker_threshold, handler.dedup.consumer)


def _in_flight(handler: Handler, delivered: Sequence[Delivered]) -> AbstractContextManager[None]:
    """``nesting.deciding`` for ``delivered`` on ``handler``'s database and table."""
    dedup = handler.dedup
    database = dedup.engine.url.render_as_string(hide_password=True)
    return deciding(database, str(dedup.tables.processed_events), dedup.consumer, delivered)


def checked(handler: object) -> Handler:
    """``handler`` if it is what ``@dedup.handler`` returns, of either deduplicator."""
    if not isinstance(handler, DedupHandler | AsyncDedupHandler):
        raise refuse("handler", handler, "what @dedup.handler or @dedup.bulk_handler returned")
    return handler


class BlockingProcessor:
    """Processes deliveries through a handler of either kind, from blocking code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer
        self.breaker = breaker_of(self.handler)
        """The runner's circuit breaker (consumerdedup.breaker), given to every batch."""
        self._loop = OwnLoop()
        self._checked = False

    def check_startup(self) -> None:
        """Once per processor, before anything is consumed: ``startup.require_startup`` on
        the handler's database and consumerdedup's own tables (ConfigurationError)."""
        if self._checked:
            return
        handler, tables = self.handler, self.handler.dedup.tables
        used = [tables.processed_events]  # a consumer's own table; its outbox may be unused
        if isinstance(handler, AsyncDedupHandler):
            self._loop.run(require_startup_async(handler.dedup.engine, tables, used))
        else:
            require_startup(handler.dedup.engine, tables, used)
        self._checked = True

    def process(
        self,
        delivered: Sequence[Delivered],
        *,
        ordered: bool = False,
        fence: OffsetFence | None = None,
    ) -> list[Result]:
        """One Result per delivery, in order (see the module's docstring); ``fence``: the
        source's offset, written in the batch's transactions (offset_fence)."""
        if hooks.process is None:  # no telemetry: this one read is all it costs
            return self._process(delivered, ordered, fence)
        spans = hooks.process.start(self.consumer, delivered)
        try:
            results = self._process(delivered, ordered, fence)
        except BaseException as exc:
            spans.fail(exc)
            raise
        spans.finish(results)
        return results

    def _process(
        self, delivered: Sequence[Delivered], ordered: bool, fence: OffsetFence | None
    ) -> list[Result]:
        breaker = self.breaker
        with _in_flight(self.handler, delivered):
            if isinstance(self.handler, AsyncDedupHandler):
                deliveries = self.handler.process_deliveries(
                    delivered, ordered=ordered, breaker=breaker, fence=fence
                )
                return self._loop.run(deliveries)
            return self.handler.process_deliveries(
                delivered, ordered=ordered, breaker=breaker, fence=fence
            )

    def close(self) -> None:
        """Close the event loop an asyncio handler ran on, if any."""
        self._loop.close()


class AsyncProcessor:
    """Processes deliveries through a handler of either kind, from asyncio code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer
        self.breaker = breaker_of(self.handler)
        """The runner's circuit breaker (consumerdedup.breaker), given to every batch."""
        self._checked = False

    async def check_startup(self) -> None:
        """``BlockingProcessor.check_startup`` from asyncio code."""
        if self._checked:
            return
        handler, tables = self.handler, self.handler.dedup.tables
        used = [tables.processed_events]  # a consumer's own table; its outbox may be unused
        if isinstance(handler, AsyncDedupHandler):
            await require_startup_async(handler.dedup.engine, tables, used)
        else:
            await asyncio.to_thread(require_startup, handler.dedup.engine, tables, used)
        self._checked = True

    async def process(
        self,
        delivered: Sequence[Delivered],
        *,
        ordered: bool = False,
        fence: OffsetFence | None = None,
    ) -> list[Result]:
        """One Result per delivery, in order (see the module's docstring); ``fence``: see
        ``BlockingProcessor.process``."""
        if hooks.process is None:  # no telemetry: this one read is all it costs
            return await self._process(delivered, ordered, fence)
        spans = hooks.process.start(self.consumer, delivered)
        try:
            results = await self._process(delivered, ordered, fence)
        except BaseException as exc:
            spans.fail(exc)
            raise
        spans.finish(results)
        return results

    async def _process(
        self, delivered: Sequence[Delivered], ordered: bool, fence: OffsetFence | None
    ) -> list[Result]:
        breaker = self.breaker
        with _in_flight(self.handler, delivered):
            if isinstance(self.handler, AsyncDedupHandler):
                return await self.handler.process_deliveries(
                    delivered, ordered=ordered, breaker=breaker, fence=fence
                )
            process = self.handler.process_deliveries
            return await asyncio.to_thread(
                process, delivered, ordered=ordered, breaker=breaker, fence=fence
            )
