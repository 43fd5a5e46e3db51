"""The group subscription: the rebalance listener, and the chunks in flight it waits for.

Several partitions of one fetch are handled at once (``KafkaConfig.partitions_in_flight``),
each chunk its own transaction. A revocation first stops new chunks from starting (the
fetch they came from is stale: the new owner reads them from the committed offset), then
waits until every chunk in flight has committed its transaction and its offset, so the
group moves on with the offsets of everything that was recorded, and nothing past it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import ConsumerRebalanceListener  # type: ignore[import-untyped]
from sqlalchemy.pool import NullPool, QueuePool

logger = logging.getLogger("consumerdedup.kafka")
OnRevoked = Callable[[Any], Awaitable[None]]
"""Called with the revoked partitions; the rebalance goes on once it returns."""


OnAssigned = Callable[[Any], None]
"""Called with the partitions assigned once a rebalance is done."""


class RebalanceListener(ConsumerRebalanceListener):  # type: ignore[misc]
    """Hands a revocation to the runner, which returns once its work in flight is done, and
    the assignment that ends the rebalance."""

    def __init__(self, on_revoked: OnRevoked, on_assigned: OnAssigned | None = None) -> None:
        self.on_revoked = on_revoked
        self.on_assigned = on_assigned

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if self.on_assigned is not None:
            self.on_assigned(assigned)


class InFlight:
    """The chunks being handled, and the epoch a revocation bumps. Made per run: its
    event binds to the run's loop."""

    def __init__(self) -> None:
        self.epoch = 0
        """Bumped by each revocation: records fetched before it are stale."""
        self.rebalancing = True
        """From a revocation until the assignment after it (and before the first one): the
        partitions the consumer lists meanwhile are not ours to judge."""
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self, epoch: int) -> bool:
        """A chunk of a fetch made at ``epoch`` starts; False (nothing started) if a
        revocation came since. Each True is followed by one ``end()``."""
        if epoch != self.epoch:
            return False
        self._count += 1
        self._idle.clear()
        return True

    def end(self) -> None:
        self._count -= 1
        if not self._count:
            self._idle.set()

    async def revoke(self) -> None:
        """No chunk of an earlier fetch starts from now on; returns once none is in flight."""
        self.epoch += 1
        self.rebalancing = True
        await self._idle.wait()

    def assigned(self) -> None:
        """The rebalance is done: what the consumer lists is ours again."""
        self.rebalancing = False


def in_flight_limit(engine: Any, wanted: int) -> int:
    """How many chunks may be in flight at once: ``wanted``, or fewer where the handler's
    engine cannot give each its own connection. Each chunk holds one connection for its
    transaction; more chunks than the pool holds would wait for one (and time out).
    SQLite takes one writer at a time: concurrent chunks would only queue on its lock."""
    sync_engine = getattr(engine, "sync_engine", engine)
    pool = getattr(sync_engine, "pool", None)
    if getattr(getattr(sync_engine, "dialect", None), "name", "") == "sqlite":
        limit = 1
    elif isinstance(pool, QueuePool):  # the async engines' AsyncAdaptedQueuePool too
        limit = max(1, pool.size())
    elif isinstance(pool, NullPool):  # a new connection each time
        limit = wanted
    else:  # StaticPool, SingletonThreadPool, AssertionPool: one connection, shared
        limit = 1
    if limit < wanted:
        logger.info(
            "%d partition chunks in flight at most, not %d: the handler's engine has %d "
            "connection(s) to give (pool_size)",
            limit,
            wanted,
            limit,
        )
    return min(limit, wanted)


async def all_of(work: Sequence[Awaitable[None]]) -> None:
    """Await every one of ``work`` concurrently. The first to raise cancels the others
    (their transactions roll back, their offsets stay uncommitted) and its error is
    raised as it is, not in an ExceptionGroup. One that ends cancelled by itself (a
    handler's CancelledError) counts as raising CancelledError: ``asyncio.wait`` would
    count it as done, and its partition's next chunk would commit past its records."""
    if len(work) == 1:
        await work[0]
        return
    tasks = [asyncio.ensure_future(w) for w in work]
    first: asyncio.Future[None] | None = None
    try:
        pending: set[asyncio.Future[None]] = set(tasks)
        while pending and first is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            first = next((t for t in done if t.cancelled() or t.exception() is not None), None)
    finally:  # an error in one, or this coroutine cancelled
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if first is not None:
        error = None if first.cancelled() else first.exception()
        raise error or asyncio.CancelledError(f"a partition's chunk was cancelled: {first!r}")
