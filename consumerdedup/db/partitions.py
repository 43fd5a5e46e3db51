"""Daily range partitions of processed_events on PostgreSQL: made ahead of time, dropped whole.

A partitioned processed_events has a DEFAULT partition, so an insert never
fails for want of a day's partition, and one partition per UTC day, made
``AHEAD`` days ahead by ``install`` and by every pruner round. A day whose
rows already sit in the DEFAULT partition cannot get its own partition any
more (PostgreSQL refuses): it is skipped, and its rows are batch-deleted
like those of an unpartitioned table.

Making or dropping a partition locks the whole table exclusively, and
consumers queue behind the DDL while it waits for that lock. So the DDL
waits at most ``LOCK_TIMEOUT`` and is tried again next round; making a day
also scans the DEFAULT partition (PostgreSQL checks it holds none of the
day's rows), bounded by ``SCAN_TIMEOUT`` for when DEFAULT has filled up.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Table, text
from sqlalchemy.exc import DBAPIError

from .names import fit_name, quote

logger = logging.getLogger("consumerdedup.partitions")

DAY = timedelta(days=1)
AHEAD = 7
"""Days of partitions made ahead; a daily pruner keeps the horizon moving."""
LOCK_TIMEOUT = "500ms"
SCAN_TIMEOUT = "2s"
_DDL_LIMITS = {"lock_timeout": LOCK_TIMEOUT}
_BOUNDS = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


@dataclass(frozen=True)
class RangePartition:
    """One partition and the processed_at range it holds: lower <= processed_at < upper."""

    name: str
    lower: datetime
    upper: datetime


class DayPartitions:
    """The partition DDL and catalog reads for one processed_events table."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self._schema_prefix = f"{quote(table.schema)}." if table.schema else ""
        self.parent = self._schema_prefix + quote(table.name)
        self.default_name = fit_name("", table.name, "default")

    def qualified(self, name: str) -> str:
        return self._schema_prefix + quote(name)

    def name_for(self, day: date) -> str:
        return fit_name("", self.table.name, f"p{day:%Y%m%d}")

    def is_partitioned(self, conn: Connection) -> bool:
        statement = text("SELECT 1 FROM pg_partitioned_table WHERE partrelid = to_regclass(:t)")
        return conn.execute(statement, {"t": self.parent}).first() is not None

    def create_default(self, conn: Connection) -> None:
        conn.execute(
            text(
                f"CREATE TABLE IF NOT EXISTS {self.qualified(self.default_name)} "
                f"PARTITION OF {self.parent} DEFAULT"
            )
        )

    def ensure(self, conn: Connection, first: date, days: int) -> list[str]:
        """Make the day partitions from ``first`` on that are missing; returns those made.

        Each is tried in a savepoint: a day PostgreSQL refuses (its rows already
        in DEFAULT, a partition of the user's overlapping it, a lock not granted
        in time) is logged and skipped, and the others are still made.
        """
        existing = {p.lower.date() for p in self.ranges(conn) if p.upper - p.lower == DAY}
        made: list[str] = []
        for offset in range(days):
            day = first + timedelta(days=offset)
            if day in existing:
                continue
            name = self.name_for(day)
            lower = datetime.combine(day, datetime.min.time(), UTC)
            try:
                with (
                    conn.begin_nested(),
                    _local(conn, **_DDL_LIMITS, statement_timeout=SCAN_TIMEOUT),
                ):
                    conn.execute(
                        text(
                            f"CREATE TABLE {self.qualified(name)} PARTITION OF {self.parent} "
                            f"FOR VALUES FROM ('{lower.isoformat()}') TO "
                            f"('{(lower + DAY).isoformat()}')"
                        )
                    )
            except DBAPIError as error:
                reason = str(getattr(error, "orig", error)).strip().splitlines()[0]
                logger.warning("partition %s for %s not made: %s", name, day, reason)
                continue
            made.append(name)
        return made

    def make_ahead(self, conn: Connection, now: datetime) -> list[str]:
        """The days from yesterday (clock skew) to ``AHEAD`` days after ``now``'s UTC day."""
        return self.ensure(conn, now.astimezone(UTC).date() - DAY, AHEAD + 2)

    def expired(self, conn: Connection, threshold: datetime) -> list[RangePartition]:
        """The partitions whose every row is older than ``threshold``."""
        return [p for p in self.ranges(conn) if p.upper <= threshold]

    def ranges(self, conn: Connection) -> list[RangePartition]:
        """The partitions with a finite range, oldest first (not DEFAULT, not MINVALUE ones)."""
        # Bounds print in the session's time zone: read them in UTC, whatever the server's.
        statement = text(
            "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
            "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass(:t)"
        )
        with _local(conn, TimeZone="UTC", DateStyle="ISO"):
            rows = conn.execute(statement, {"t": self.parent}).all()
        found: list[RangePartition] = []
        for name, bound in rows:
            match = _BOUNDS.search(bound or "")
            if match is None:
                continue
            try:
                lower, upper = (_instant(value) for value in match.groups())
            except ValueError:
                continue
            found.append(RangePartition(name, lower, upper))
        return sorted(found, key=lambda p: (p.lower, p.upper))

    def summary(self, conn: Connection) -> dict[str, Any] | None:
        """For ``stats``: the range partitions and the DEFAULT partition's rows; None if
        the table is not partitioned. Rows in DEFAULT mean days were not made in time."""
        if not self.is_partitioned(conn):
            return None
        ranges = self.ranges(conn)
        exists = text("SELECT to_regclass(:d) IS NOT NULL")
        in_default: Any = 0
        if conn.execute(exists, {"d": self.qualified(self.default_name)}).scalar():
            default = text(f"SELECT count(*) FROM {self.qualified(self.default_name)}")
            in_default = conn.execute(default).scalar()
        return {
            "partitions": len(ranges),
            "oldest_from": ranges[0].lower.isoformat() if ranges else None,
            "newest_to": ranges[-1].upper.isoformat() if ranges else None,
            "rows_in_default": int(in_default or 0),
        }

    def count(self, conn: Connection, partition: RangePartition) -> Counter[str]:
        statement = text(
            f"SELECT consumer, count(*) FROM {self.qualified(partition.name)} GROUP BY consumer"
        )
        return Counter({consumer: int(n) for consumer, n in conn.execute(statement)})

    def drop(self, conn: Connection, partition: RangePartition) -> None:
        with _local(conn, **_DDL_LIMITS):
            conn.execute(text(f"DROP TABLE {self.qualified(partition.name)}"))


@contextmanager
def _local(conn: Connection, **settings: str) -> Iterator[None]:
    """Settings for the statements inside only; the caller's transaction keeps its own.

    Restored on success; after an error, the rollback that must follow undoes them.
    """
    names = list(settings)
    params = {f"n{i}": name for i, name in enumerate(names)}
    read = "SELECT " + ", ".join(f"current_setting(:n{i})" for i in range(len(names)))
    write = "SELECT " + ", ".join(f"set_config(:n{i}, :v{i}, true)" for i in range(len(names)))
    saved = conn.execute(text(read), params).one()
    conn.execute(text(write), {**params, **{f"v{i}": settings[n] for i, n in enumerate(names)}})
    yield
    conn.execute(text(write), {**params, **{f"v{i}": v for i, v in enumerate(saved)}})


def _instant(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def today() -> date:
    return datetime.now(UTC).date()
