"""The partition dropper: a range-partitioned processed_events loses whole days first.

Every round makes the day partitions ahead, then drops those whose upper
bound is at or before every consumer's cutoff (``Cutoffs.whole_partitions``),
so each of their rows is older than its own window. Each drop counts the
partition's rows per consumer first, in the same short transaction; a drop
that cannot get its lock in time is skipped, and the row batches that follow
take those rows instead.
"""

from __future__ import annotations

import logging
from collections import Counter

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

from ..db.partitions import DayPartitions
from ..reasons import describe
from ..schema import Tables
from .rounds import Pace, Round
from .windows import Cutoffs

logger = logging.getLogger("consumerdedup.pruner")


class PartitionDropper:
    """Drops the wholly expired day partitions of one processed_events (PostgreSQL)."""

    def __init__(self, tables: Tables, pace: Pace) -> None:
        self.partitions = DayPartitions(tables.processed_events)
        self.table = tables.processed_events.fullname
        self.pace = pace

    def drop(self, conn: Connection, state: Round) -> tuple[Counter[str], list[str]]:
        """Make the days ahead, drop the days wholly expired: (rows per consumer, names)."""
        deleted: Counter[str] = Counter()
        dropped: list[str] = []
        with conn.begin():
            if not self.partitions.is_partitioned(conn):
                return deleted, dropped
            self.partitions.make_ahead(conn, state.now)
        threshold = state.cutoffs.whole_partitions()
        if threshold is None:
            return deleted, dropped
        with conn.begin():
            expired = self.partitions.expired(conn, threshold)
        for partition in expired:
            if self.pace.stopping:
                break
            try:
                with conn.begin():
                    counts = self.partitions.count(conn, partition)
                    self.partitions.drop(conn, partition)
            except DBAPIError as error:
                logger.warning("partition %s not dropped (%s)", partition.name, describe(error))
                continue
            deleted.update(counts)
            dropped.append(partition.name)
            logger.info("dropped partition %s (%d rows)", partition.name, counts.total())
            self.pace.tell(self.table, deleted.total(), state)
        return deleted, dropped

    def expired(self, conn: Connection, cutoffs: Cutoffs) -> tuple[str, ...]:
        """Dry run: the partitions a round at these cutoffs would drop."""
        threshold = cutoffs.whole_partitions()
        if threshold is None or not self.partitions.is_partitioned(conn):
            return ()
        return tuple(p.name for p in self.partitions.expired(conn, threshold))
