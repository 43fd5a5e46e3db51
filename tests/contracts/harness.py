"""The runner contract's harness, written once: a broker adds only its probes.

``RunnerHarness`` builds the scenarios' handler, runs a runner until its source is
drained or in the background until stopped (on the harness's own event loop, in a
thread, when ``run()`` is a coroutine), and crashes it between commit and ack. A
broker's harness subclasses it, states its ``Capabilities``, and fills in four
probes: ``publish``, ``runner`` (a fresh one, configured for quick tests), ``held``
and ``dead_letters``. faststream's per-broker test configs have the same shape.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, ClassVar, Protocol, Self, TypeVar

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from consumerdedup import (
    AsyncDedupHandler,
    AsyncDeduplicator,
    DedupHandler,
    Deduplicator,
    Message,
    Result,
    RetryPolicy,
    SimulatedCrash,
)
from consumerdedup.lifecycle import BeforeAck
from tests.support.flavors import Behavior

T = TypeVar("T")


@dataclass(frozen=True)
class Capabilities:
    """What really differs between brokers; the suite checks the weaker promise where one
    cannot keep the stronger."""

    ordered: bool = True
    """Messages of one partition (or queue, with one consumer) are handled in publish order."""
    batches: bool = True
    """The runner can handle several messages per transaction."""
    retry_keeps_order: bool = False
    """A message to retry holds back the ones behind it, which come again after it (Kafka
    re-reads the partition from it). Elsewhere they may overtake it (RabbitMQ requeues it
    behind what was prefetched; the memory broker's batch-mates are acked)."""


QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def ledger_handler(
    db: Any,
    behavior: Behavior,
    told: list[Result],
    *,
    asyncio: bool,
    async_engine: AsyncEngine | None = None,
    bulk: bool = False,
) -> DedupHandler | AsyncDedupHandler:
    """The scenarios' handler, of a Deduplicator or of an AsyncDeduplicator (on
    ``async_engine``, else on an engine without a pool, which no event loop owns).
    ``bulk``: a bulk handler, one call per transaction running every message's SQL."""
    if not asyncio:
        dedup = Deduplicator(
            db.engine,
            consumer="ledger",
            tables=db.tables,
            retry=QUICK_RETRY,
            dead_letter=told.append,
        )
        if bulk:

            @dedup.bulk_handler
            def handle_bulk(messages: list[Message], session: Any) -> None:
                for message in messages:
                    for sql, params in behavior(message):
                        session.execute(text(sql), params)

            return handle_bulk

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            for sql, params in behavior(message):
                session.execute(text(sql), params)

        return handle
    engine = async_engine or create_async_engine(db.async_url, poolclass=NullPool)
    async_dedup = AsyncDeduplicator(
        engine, consumer="ledger", tables=db.tables, retry=QUICK_RETRY, dead_letter=told.append
    )
    if bulk:

        @async_dedup.bulk_handler
        async def handle_bulk_async(messages: list[Message], session: Any) -> None:
            for message in messages:
                for sql, params in behavior(message):
                    await session.execute(text(sql), params)

        return handle_bulk_async

    @async_dedup.handler
    async def handle_async(message: Message, session: Any) -> None:
        for sql, params in behavior(message):
            await session.execute(text(sql), params)

    return handle_async


def crash(results: Sequence[Result]) -> None:
    """The ``before_ack`` hook of a runner that dies between commit and ack."""
    raise SimulatedCrash("died between the database commit and the ack")


class Runner(Protocol):
    def run(self, *, until_idle: bool = False) -> Any:
        """None, or a coroutine for an asyncio runner."""

    def stop(self, deadline: float | None = None) -> None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def last_tick(self) -> float: ...


def until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class Running:
    """A runner running in the background (a thread, or the harness's event loop)."""

    def __init__(self, runner: Runner, finished: Callable[[float], bool]) -> None:
        self.runner = runner
        self._finished = finished

    def wait(self, timeout: float = 30.0) -> bool:
        """True once ``run()`` has returned (its error, if any, raised here)."""
        return self._finished(timeout)

    def stop(self, deadline: float | None = None) -> None:
        """stop() and wait for run() to return."""
        self.runner.stop(deadline)
        assert self.wait(30), "the runner did not stop"


class RunnerHarness:
    """What the suite drives; a broker's subclass fills in the probes below."""

    capabilities: ClassVar[Capabilities]
    asyncio_by_default: ClassVar[bool] = False
    """The kind of handler the broker's example uses, when a scenario does not say."""
    async_engine: AsyncEngine | None = None
    """The AsyncDeduplicator's engine; None: one without a pool per handler."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.told: list[Result] = []
        """What the deduplicator's dead-letter hook was told, in order."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # The probes: one broker each.

    def publish(self, message_id: str | None, body: bytes) -> None:
        """Publish one message with ``message_id`` carried the broker's usual way."""
        raise NotImplementedError

    def runner(self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None) -> Runner:
        """A fresh runner of the source, without waits before a retry."""
        raise NotImplementedError

    def held(self) -> int:
        """How many messages the broker still holds for the source (ready plus unacked)."""
        raise NotImplementedError

    def dead_letters(self) -> list[tuple[str | None, str]]:
        """(message id, reason) of each dead-lettered message, in order."""
        raise NotImplementedError

    # The same for every broker.

    def consume(
        self,
        behavior: Behavior,
        *,
        batch_size: int = 1,
        crash_after_commit: bool = False,
        asyncio: bool | None = None,
        bulk: bool = False,
    ) -> None:
        """Run a fresh runner until the source is drained; a crash raises SimulatedCrash.
        ``asyncio``: an AsyncDeduplicator's handler (True) or a Deduplicator's (False);
        None: the kind the broker's example uses. ``bulk``: a bulk handler."""
        before_ack = crash if crash_after_commit else None
        runner = self._fresh(behavior, batch_size, before_ack, asyncio, bulk)
        done = runner.run(until_idle=True)
        if inspect.iscoroutine(done):
            self.call(done)

    def start(self, behavior: Behavior, *, batch_size: int = 1) -> Callable[[], None]:
        """Run a fresh runner in the background; returns a function that stops it and waits."""
        return self.launch(self.fresh(behavior, batch_size=batch_size)).stop

    def fresh(self, behavior: Behavior, *, batch_size: int = 1) -> Runner:
        """A fresh runner of the broker's usual handler kind, not started."""
        return self._fresh(behavior, batch_size, None, None)

    def launch(self, runner: Runner) -> Running:
        """Run ``runner`` in the background until it is stopped."""
        if inspect.iscoroutinefunction(runner.run):
            future = asyncio.run_coroutine_threadsafe(runner.run(), self.loop)

            def finished(timeout: float) -> bool:
                try:
                    future.result(timeout)
                except TimeoutError:
                    return False
                return True

            return Running(runner, finished)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                runner.run()
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def joined(timeout: float) -> bool:
            thread.join(timeout)
            if failure:
                raise failure[0]
            return not thread.is_alive()

        return Running(runner, joined)

    def run_here(self, runner: Runner) -> None:
        """Run ``runner`` until stopped with the calling thread waiting on it: the runner
        itself for a blocking one, its future on the harness's loop for an asyncio one."""
        done = runner.run()
        if inspect.iscoroutine(done):
            self.call(done)

    def _fresh(
        self,
        behavior: Behavior,
        batch_size: int,
        before_ack: BeforeAck | None,
        kind: bool | None,
        bulk: bool = False,
    ) -> Runner:
        asyncio = self.asyncio_by_default if kind is None else kind
        handler = ledger_handler(
            self.db, behavior, self.told, asyncio=asyncio, async_engine=self.async_engine, bulk=bulk
        )
        return self.runner(handler, batch_size=batch_size, before_ack=before_ack)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The harness's event loop, running in a thread of its own from first use."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
            self._thread.start()
        return self._loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        """Run ``coro`` on the harness's event loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
