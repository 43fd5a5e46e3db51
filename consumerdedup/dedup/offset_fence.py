"""A source's position committed in the batch's own transactions, fenced by an owner epoch.

A runner that keeps a Kafka partition's offset in the database (the Kafka runner's
``KafkaConfig(offsets="database")``) hands the pipeline an ``OffsetFence`` with each
chunk. Before every COMMIT of the chunk, the pipeline writes the partition's next offset:
one past the longest run of the chunk's deliveries, from its first, that are decided (or
committed by this very transaction). The write is conditional on the owner epoch the
runner took when it was assigned the partition: a consumer the group has moved on from
(its successor bumped the epoch) changes no row, and the pipeline rolls the whole
transaction back: nothing of it commits, and every undecided message ends RETRY with
``PartitionFenced``. The same statements serve the blocking and the asyncio drivers.

With ``claims=False`` the offset alone decides what was applied: no processed_events row
is claimed for a message that commits (a FAILED one still gets its record, for ``failed
list``/``replay``, and so do those applied behind it in its batch: the offset waits before
a FAILED message until its dead letter is sent, and ``recheck`` finds them if read
again). A producer's retried copy of a message, at another offset, is then applied again:
see docs/kafka.md for which guarantee holds in which combination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Table, and_, bindparam, case, func, select, text, update
from sqlalchemy.dialects import postgresql

from ..db.names import table_sql
from ..errors import RetryLater
from ..schema import utcnow
from .driver_sql import DriverSQL


class PartitionFenced(RetryLater):
    """The partition's owner epoch moved on (another consumer was assigned it): this
    consumer's transaction was rolled back, nothing of it committed."""


@dataclass(frozen=True)
class OffsetStatements:
    """The conditional offset write on one consumer_offsets table, and the epoch's read."""

    advance: Any
    """The write, as SQLAlchemy Core: for a transaction of its own (OffsetStore.advance)."""
    epoch: Any
    """The owner epoch's read, as SQLAlchemy Core."""
    in_batch: Any
    """The write in a chunk's transaction: on PostgreSQL text built once for the driver
    (driver_sql: no SQLAlchemy execution per chunk), else ``advance``."""
    epoch_in_batch: Any
    """The partition's owner epoch now: without claims, a transaction's first statement (it
    opens the transaction before the handler runs, and a fenced chunk stops before it; on
    PostgreSQL its BEGIN goes out with it, in one round trip: transaction_start)."""
    begin: Any = None
    """MySQL/MariaDB: START TRANSACTION before the epoch's read. A plain SELECT opens no
    transaction the server reports (its status flag stays off until a write), so the
    handler guard refused every offsets-only chunk as a setup fault (ConfigurationError)."""

    @classmethod
    def of(cls, table: Table, dialect: str = "") -> OffsetStatements:
        c = table.c
        advance = (
            update(table)
            .where(
                c.consumer_group == bindparam("g"),
                c.topic == bindparam("t"),
                c.partition == bindparam("p"),
                c.owner_epoch == bindparam("e"),
            )
            # None: the transaction moved no offset (it only checks the epoch).
            .values(
                next_offset=func.coalesce(bindparam("n", type_=BigInteger), c.next_offset),
                updated_at=bindparam("now"),
                recheck_until=case(
                    (
                        and_(
                            bindparam("r", type_=BigInteger).is_not(None),
                            func.coalesce(c.recheck_until, -1) < bindparam("r", type_=BigInteger),
                        ),
                        bindparam("r", type_=BigInteger),
                    ),
                    else_=c.recheck_until,
                ),
            )
        )
        epoch = select(c.owner_epoch).where(
            c.consumer_group == bindparam("g"),
            c.topic == bindparam("t"),
            c.partition == bindparam("p"),
        )
        if dialect in ("mysql", "mariadb"):
            return cls(advance, epoch, advance, epoch, text("START TRANSACTION"))
        if dialect != "postgresql":
            return cls(advance, epoch, advance, epoch)
        made: Any = postgresql.dialect
        q = made().identifier_preparer.quote
        name = table_sql(table)
        key = (
            f"{q(c.consumer_group.name)} = %(g)s AND {q(c.topic.name)} = %(t)s "
            f"AND {q(c.partition.name)} = %(p)s"
        )
        until = q(c.recheck_until.name)
        moved = DriverSQL(
            f"UPDATE {name} SET {q(c.next_offset.name)} = "
            f"coalesce(%(n)s::bigint, {q(c.next_offset.name)}), {q(c.updated_at.name)} = "
            f"%(now)s, {until} = CASE WHEN %(r)s::bigint IS NOT NULL AND coalesce({until}, -1) "
            f"< %(r)s::bigint THEN %(r)s::bigint ELSE {until} END "
            f"WHERE {key} AND {q(c.owner_epoch.name)} = %(e)s RETURNING 1"
        )
        owner = DriverSQL(f"SELECT {q(c.owner_epoch.name)} FROM {name} WHERE {key}")
        return cls(advance, epoch, moved, owner)


@dataclass(eq=False)
class OffsetFence:
    """One partition of one group, owned at ``epoch``: what a chunk's transactions write."""

    statements: OffsetStatements
    group: str
    topic: str
    partition: int
    epoch: int
    claims: bool = True
    """Claim each message's id in processed_events too (a producer's retried copy at another
    offset is then answered DUPLICATE); False: the offset alone decides."""
    written: int | None = None
    """The next offset the last committed transaction wrote (None: none yet)."""
    fenced: bool = False
    """A write changed no row: the partition is another consumer's now."""
    recheck_until: int | None = None
    """The partition's ``recheck_until`` (consumer_offsets): records of messages below it
    may stand though the offset is below them. Raised to a chunk's end by a commit that
    held the offset before it."""
    recheck: bool = False
    """Without claims: the batch starts below ``recheck_until`` (OffsetStore.fence), so some
    of its messages may have records: a FAILED one whose offset waited for its dead letter
    and those applied behind it, or a copy of an id whose chunk was claimed (an id twice in
    it). Their keys are looked up, one SELECT; if one has a record, the batch is claimed.
    Off once a lookup has answered (a failed one is tried again with the next attempt)."""

    def params(self, next_offset: int | None, held_to: int | None = None) -> dict[str, Any]:
        """``held_to``: the end of a chunk whose commit holds the offset before it (raises
        ``recheck_until``); None: left as it is."""
        return {
            "g": self.group,
            "t": self.topic,
            "p": self.partition,
            "e": self.epoch,
            "n": next_offset,
            "now": utcnow(),
            "r": held_to,
        }

    def key(self) -> dict[str, Any]:
        return {"g": self.group, "t": self.topic, "p": self.partition}

    @staticmethod
    def read(result: Any) -> int:
        """Rows the write changed: a Result's rowcount, or the driver's rows (RETURNING)."""
        return int(result.rowcount) if hasattr(result, "rowcount") else len(result)

    @staticmethod
    def read_epoch(result: Any) -> int | None:
        if hasattr(result, "scalar_one_or_none"):
            return result.scalar_one_or_none()  # type: ignore[no-any-return]
        return None if not result else result[0][0]
