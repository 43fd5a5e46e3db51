"""The partitions a runner with offsets in the database owns, and where each starts.

An assigned partition is paused at once (in the rebalance callback, which does no I/O of
its own here) and taken by the consume loop before it is read: its owner epoch bumped, its
stored offset read (offsets.OffsetStore.take). It then starts at the database's offset,
else at the group's committed offset, else where ``auto_offset_reset`` says, and a log line
says which. When the database is ahead of the broker, the broker's commit is moved up to it
at once, so lag tooling (and ``run(until_idle=True)``) sees what is done.

A partition whose offset write changed no row (another consumer took it since: fenced) is
dropped and paused until the next assignment: none of its records is handled here again.
A revoked one is dropped after the chunks in flight are done (the runner waits for them):
no offset of a revoked partition is written after its revocation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from consumerdedup.options import refuse
from consumerdedup.reasons import describe
from consumerdedup.retry import ErrorKind, classify, setup_fault
from consumerdedup.startup import require_startup, require_startup_async

from . import acks
from .offsets import OffsetStore, Owned

logger = logging.getLogger("consumerdedup.kafka")


class Ownership:
    """The partitions owned (and the epoch of each), and those assigned but not taken yet."""

    def __init__(self, store: OffsetStore, claims: bool) -> None:
        self.store = store
        self.claims = claims
        self.owned: dict[Any, Owned] = {}
        self.pending: set[Any] = set()
        self._news: asyncio.Future[None] | None = None

    def news(self) -> asyncio.Future[None]:
        """Done at the next assignment: a fetch waiting then stops waiting, as the partitions
        it brought stay paused until the loop takes them (a poll_timeout of nothing, at
        every start and rebalance). Not done for partitions already pending (a take that
        failed): their next try waits for the fetch, as it should."""
        if self._news is None or self._news.done():
            self._news = asyncio.get_running_loop().create_future()
        return self._news

    async def check_startup(self, handler: Any) -> None:
        """consumer_offsets exists with its key and columns, and may be written, on the
        handler's engine (the start checks: a missing table or column is a setup fault,
        ConfigurationError naming it and the fix)."""
        engine, tables = handler.dedup.engine, handler.dedup.tables
        if tables.consumer_offsets is None:
            raise refuse(
                'KafkaConfig(offsets="database")',
                "database",
                "a handler whose Tables have consumer_offsets (Tables.define())",
            )
        needed = [tables.offsets]
        if hasattr(engine, "sync_engine"):
            await require_startup_async(engine, tables, needed)
        else:
            await asyncio.to_thread(require_startup, engine, tables, needed)

    def assigned(self, consumer: Any, partitions: Iterable[Any]) -> None:
        """In the rebalance callback: hold the partitions until ``take`` has run."""
        fresh = set(partitions)
        self.pending |= fresh
        if fresh:
            consumer.pause(*fresh)
            if self._news is not None and not self._news.done():
                self._news.set_result(None)

    def revoked(self, partitions: Iterable[Any]) -> None:
        for tp in partitions:
            self.owned.pop(tp, None)
            self.pending.discard(tp)

    def fenced(self, consumer: Any, tp: Any) -> None:
        """Another consumer owns ``tp`` now: nothing more of it here until it is assigned
        to us again (then taken anew)."""
        self.owned.pop(tp, None)
        logger.warning(
            "%s was taken by another consumer of group %r (owner epoch moved on): this "
            "consumer's chunk rolled back; the partition is left to its new owner",
            tp,
            self.store.group,
        )
        if tp in consumer.assignment():
            consumer.pause(tp)

    async def take(self, consumer: Any, positions: dict[Any, int], epoch: Any) -> None:
        """Take the pending partitions still assigned, seek each to where it starts, and
        resume it. ``epoch``: called to tell whether a revocation came during an await
        (then the next assignment takes its partitions anew)."""
        start = epoch()
        pending = sorted((tp for tp in self.pending if tp in consumer.assignment()), key=str)
        self.pending.intersection_update(pending)
        if not pending:
            return
        try:
            taken = await self.store.take([(tp.topic, tp.partition) for tp in pending])
        except Exception as exc:
            if not passing(exc):
                raise  # a missing table or right: the runner stops, naming it
            logger.warning(
                "the offsets of %d assigned partitions could not be read (%s): they stay "
                "paused, and are taken again at the next fetch",
                len(pending),
                describe(exc),
            )
            return
        for tp in pending:
            owned = taken[tp.topic, tp.partition]
            committed = await consumer.committed(tp)
            if epoch() != start or tp not in consumer.assignment():
                return  # revoked meanwhile: its next owner takes it
            if owned.stored is not None:
                consumer.seek(tp, owned.stored)
                positions[tp] = owned.stored
                source, at = "the database", owned.stored
                if committed is None or committed != owned.stored:
                    await acks.commit(consumer, tp, owned.stored)  # lag tooling follows
            elif committed is not None:
                source, at = "the group's committed offset (none in the database)", committed
            else:
                source, at = "auto_offset_reset (no offset in the database or the group)", None
            logger.info(
                "%s (owner epoch %d) starts at %s: %s",
                tp,
                owned.epoch,
                "the reset position" if at is None else f"offset {at}",
                source,
            )
            self.owned[tp] = owned
            self.pending.discard(tp)
            consumer.resume(tp)

    async def advance(self, consumer: Any, tp: Any, fence: Any, next_offset: int) -> bool:
        """Write ``next_offset`` outside the chunk's transactions; False if ``tp`` was fenced
        (dropped) or the database failed for now (then ``tp`` is read again from the offset
        stored: what follows it comes again)."""
        try:
            if await self.store.advance(fence, next_offset):
                return True
        except Exception as exc:
            if not passing(exc):
                raise
            logger.warning("offset of %s not written (%s): read again", tp, describe(exc))
            stored = self.start_of(tp)
            if stored is not None:
                acks.seek(consumer, tp, stored)
            return False
        self.fenced(consumer, tp)
        return False

    def start_of(self, tp: Any) -> int | None:
        """Where ``tp`` is to be read again from: the offset stored for it, if owned."""
        owned = self.owned.get(tp)
        return None if owned is None else owned.stored


def passing(error: BaseException) -> bool:
    """A database error that may pass (a lost connection, a deadlock), not a setup fault."""
    return classify(error) is ErrorKind.TRANSIENT and not setup_fault(error)
