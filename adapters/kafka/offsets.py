"""Offsets in the database (``KafkaConfig(offsets="database")``): taking a partition, and
writing its next offset outside a chunk's transaction.

Taking a partition (each time the group assigns it to this consumer) bumps its owner epoch
in consumer_offsets and reads the stored next offset, in one transaction: the UPDATE waits
for a transaction of the previous owner that holds the row (its chunk's offset write) and
then reads what it committed, so the new owner starts exactly where the old one stopped.
From then on, every offset write of the old owner carries the old epoch and changes no row
(consumerdedup.dedup.offset_fence): its transaction rolls back, nothing of it commits.

Chunks write their offset in their own transactions (the pipeline, through the
OffsetFence); ``advance`` is for what no transaction of the chunk covered (records the
runner refused at the chunk's end, decided FAILED with nothing to commit).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from consumerdedup.dedup.offset_fence import OffsetFence, OffsetStatements
from consumerdedup.schema import Tables, utcnow

T = TypeVar("T")


@dataclass
class Owned:
    """A partition this consumer was assigned: the epoch it took, the offset stored then
    (None: nothing stored yet) and kept up as its chunks commit."""

    epoch: int
    stored: int | None
    recheck_until: int | None = None
    """consumer_offsets' ``recheck_until`` as taken, raised as chunks commit: a chunk that
    starts below it is looked up (OffsetFence.recheck)."""


def first_epoch() -> int:
    """The owner epoch of a row made anew: the time in microseconds, not 1. A row deleted by
    hand (a topic made again, an offset reset) while a consumer still runs a chunk of its
    partition would otherwise give that consumer's epoch to the next owner, and its stale
    chunk would commit (twice applied, the offset moved back). Later bumps add 1: a
    partition is assigned far less often than once a microsecond."""
    return time.time_ns() // 1000


class OffsetStore:
    """One group's rows in consumer_offsets, through the handler's engine."""

    def __init__(self, engine: Engine | AsyncEngine, tables: Tables, group: str) -> None:
        self.engine = engine
        self.table = tables.offsets
        self.group = group
        self.statements = OffsetStatements.of(self.table, engine.dialect.name)

    async def take(self, partitions: Sequence[tuple[str, int]]) -> dict[tuple[str, int], Owned]:
        """Bump the owner epoch of each (topic, partition) and read its stored offset; in
        one transaction, in key order (two consumers taking partitions wait, not deadlock)."""
        ordered = sorted(partitions)
        try:
            return await self._run(lambda conn: self._take(conn, ordered))
        except IntegrityError:  # another consumer inserted a row first: it exists now
            return await self._run(lambda conn: self._take(conn, ordered))

    def _take(
        self, conn: Connection, partitions: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], Owned]:
        table, c, now = self.table, self.table.c, utcnow()
        taken: dict[tuple[str, int], Owned] = {}
        for topic, partition in partitions:
            where = (c.consumer_group == self.group, c.topic == topic, c.partition == partition)
            bumped = conn.execute(
                update(table).where(*where).values(owner_epoch=c.owner_epoch + 1, updated_at=now)
            )
            if not bumped.rowcount:
                row = {"consumer_group": self.group, "topic": topic, "partition": partition}
                fresh = first_epoch()
                conn.execute(insert(table).values(**row, owner_epoch=fresh, updated_at=now))
            stored, epoch, until = conn.execute(
                select(c.next_offset, c.owner_epoch, c.recheck_until).where(*where)
            ).one()
            taken[topic, partition] = Owned(
                int(epoch),
                None if stored is None else int(stored),
                None if until is None else int(until),
            )
        return taken

    def fence(
        self, topic: str, partition: int, owned: Owned, claims: bool, first: int | None = None
    ) -> OffsetFence:
        """What a chunk of this partition's transactions write, at the epoch taken.
        ``first``: the chunk's first offset; without claims, a chunk that starts below the
        partition's ``recheck_until`` (or one whose start is not given, while it is set)
        looks its ids up (OffsetFence.recheck)."""
        until = owned.recheck_until
        below = until is not None and (first is None or first < until)
        return OffsetFence(
            self.statements,
            self.group,
            topic,
            partition,
            owned.epoch,
            claims=claims,
            written=owned.stored,
            recheck_until=until,
            recheck=below and not claims,
        )

    @staticmethod
    def committed(owned: Owned, fence: OffsetFence) -> None:
        """What a chunk's transactions committed, kept up in ``owned``: the offset stored
        (a read again starts there, not before) and ``recheck_until``."""
        if fence.written is not None and (owned.stored is None or fence.written > owned.stored):
            owned.stored = fence.written
        owned.recheck_until = fence.recheck_until

    async def advance(self, fence: OffsetFence, next_offset: int) -> bool:
        """Write ``next_offset`` in a transaction of its own; False if the epoch moved on."""

        def write(conn: Connection) -> bool:
            params = fence.params(next_offset)
            return bool(fence.read(conn.execute(fence.statements.advance, params)))

        return await self._run(write)

    async def stored(self, topic: str, partition: int) -> tuple[int | None, int] | None:
        """(next offset, owner epoch) of a partition, None if it has no row; for tools."""
        c = self.table.c

        def read(conn: Connection) -> tuple[int | None, int] | None:
            row = conn.execute(
                select(c.next_offset, c.owner_epoch).where(
                    c.consumer_group == self.group, c.topic == topic, c.partition == partition
                )
            ).one_or_none()
            return None if row is None else (row[0], row[1])

        return await self._run(read)

    async def _run(self, work: Callable[[Connection], T]) -> T:
        """``work`` in a transaction on the handler's engine, of either kind."""
        engine: Any = self.engine
        if isinstance(engine, AsyncEngine):
            async with engine.begin() as conn:
                return await conn.run_sync(work)

        def blocking() -> T:
            with engine.begin() as conn:
                return work(conn)

        return await asyncio.to_thread(blocking)
