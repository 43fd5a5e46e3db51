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

from ..errors import ConfigurationError
from ..event_loop import OwnLoop
from ..outcome import Result
from ..startup import require_startup, require_startup_async
from ..telemetry import hooks
from .async_deduplicator import AsyncDedupHandler
from .deduplicator import DedupHandler
from .pipeline import Delivered

Handler = DedupHandler | AsyncDedupHandler

__all__ = ["AsyncProcessor", "BlockingProcessor", "Delivered", "Handler", "checked"]


def checked(handler: object) -> Handler:
    """``handler`` if it is what ``@dedup.handler`` returns, of either deduplicator."""
    if not isinstance(handler, DedupHandler | AsyncDedupHandler):
        raise ConfigurationError("handler must be what @dedup.handler returned")
    return handler


class BlockingProcessor:
    """Processes deliveries through a handler of either kind, from blocking code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer
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

    def process(self, delivered: Sequence[Delivered], *, ordered: bool = False) -> list[Result]:
        """One Result per delivery, in order (see the module's docstring)."""
        if hooks.process is None:  # no telemetry: this one read is all it costs
            return self._process(delivered, ordered)
        spans = hooks.process.start(self.consumer, delivered)
        try:
            results = self._process(delivered, ordered)
        except BaseException as exc:
            spans.fail(exc)
            raise
        spans.finish(results)
        return results

    def _process(self, delivered: Sequence[Delivered], ordered: bool) -> list[Result]:
        if isinstance(self.handler, AsyncDedupHandler):
            return self._loop.run(self.handler.process_deliveries(delivered, ordered=ordered))
        return self.handler.process_deliveries(delivered, ordered=ordered)

    def close(self) -> None:
        """Close the event loop an asyncio handler ran on, if any."""
        self._loop.close()


class AsyncProcessor:
    """Processes deliveries through a handler of either kind, from asyncio code."""

    def __init__(self, handler: object) -> None:
        self.handler = checked(handler)
        self.consumer = self.handler.dedup.consumer
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
        self, delivered: Sequence[Delivered], *, ordered: bool = False
    ) -> list[Result]:
        """One Result per delivery, in order (see the module's docstring)."""
        if hooks.process is None:  # no telemetry: this one read is all it costs
            return await self._process(delivered, ordered)
        spans = hooks.process.start(self.consumer, delivered)
        try:
            results = await self._process(delivered, ordered)
        except BaseException as exc:
            spans.fail(exc)
            raise
        spans.finish(results)
        return results

    async def _process(self, delivered: Sequence[Delivered], ordered: bool) -> list[Result]:
        if isinstance(self.handler, AsyncDedupHandler):
            return await self.handler.process_deliveries(delivered, ordered=ordered)
        process = self.handler.process_deliveries
        return await asyncio.to_thread(process, delivered, ordered=ordered)
