"""The outbox on MySQL and MariaDB: the server floor, and the producers' per-key locks.

The relay claims with ``SELECT ... FOR UPDATE SKIP LOCKED`` (statements.py), which MySQL
has from 8.0.1 and MariaDB from 10.6: an older server would take the clause as a syntax
error or (MariaDB before 10.6) wait on locked rows, so it is refused at start, naming
the version found.

Per-key order needs same-key producers to commit in the order their rows were numbered:
InnoDB allocates an AUTO_INCREMENT id at the INSERT, not at COMMIT, so two transactions
adding events of one key could commit in the other order, and a relay publish the later
row first. PostgreSQL serializes them on an advisory lock; MySQL's GET_LOCK cannot do
that job (session-scoped: it survives COMMIT and ROLLBACK, stacks, and is node-local on
Galera). Here a producer takes a row lock, in its own transaction, on one row of a small
fixed table (``<outbox>_key_locks``, ``BUCKETS`` rows made by ``install()``, see
schema.mysql_outbox): the key's
bucket, a stable hash of the key. The lock is released by COMMIT or ROLLBACK, whatever
the session does next. Two keys that share a bucket serialize their producers too (about
one pair in ``BUCKETS``): a little waiting, never a wrong order. The relay never takes
these locks: a producer's open transaction does not hold back the key's committed rows.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, Table, bindparam, select

from ..errors import ConfigurationError
from ..schema.mysql_outbox import BUCKETS, key_locks_table

DIALECTS = ("mysql", "mariadb")
"""SQLAlchemy's names for the two (``mariadb://`` URLs get their own)."""
MARIADB_FLOOR = (10, 6)
MYSQL_FLOOR = (8, 0, 1)
_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)")


def is_mysql(dialect_name: str) -> bool:
    return dialect_name in DIALECTS


def require_skip_locked(conn: Connection, what: str) -> None:
    """ConfigurationError unless the server has ``FOR UPDATE SKIP LOCKED``."""
    refuse_without_skip_locked(str(conn.exec_driver_sql("SELECT VERSION()").scalar_one()), what)


def refuse_without_skip_locked(found: str, what: str) -> None:
    """ConfigurationError unless ``found`` (``SELECT VERSION()``) is a server with SKIP
    LOCKED: MariaDB 10.6 or later (its version says MariaDB), else MySQL 8.0.1 or later."""
    match = _VERSION.match(found)
    mariadb = "mariadb" in found.lower()
    floor = MARIADB_FLOOR if mariadb else MYSQL_FLOOR
    version = tuple(int(part) for part in match.groups()) if match else (0, 0, 0)
    if version < floor:
        product = "MariaDB" if mariadb else "MySQL"
        wanted = ".".join(map(str, floor))
        raise ConfigurationError(
            f"{what}: the server is {product} {found}; the relay claims rows with SELECT ... "
            f"FOR UPDATE SKIP LOCKED, which {product} has from {wanted}: upgrade the server "
            f"to {product} {wanted} or later (MySQL 8.0.1, MariaDB 10.6)"
        )


def bucket_of(key: str) -> int:
    """The key's bucket: the same in every process and release (CRC-32 of its UTF-8)."""
    return zlib.crc32(key.encode()) % BUCKETS


class KeyLocks:
    """The producers' lock statement over one outbox's key-lock table."""

    def __init__(self, outbox: Table) -> None:
        self.outbox = outbox
        self.table = table = key_locks_table(outbox)
        # In bucket order: two transactions locking several keys take them in one order.
        self.statement = (
            select(table.c.bucket)
            .where(table.c.bucket.in_(bindparam("buckets", expanding=True)))
            .order_by(table.c.bucket)
            .with_for_update()
        )

    def params(self, keys: Iterable[str]) -> dict[str, Any]:
        return {"buckets": sorted({bucket_of(key) for key in keys})}

    def check(self, wanted: dict[str, Any], locked: list[Any]) -> None:
        """Fails closed: a bucket row missing would lock nothing, and the key's producers
        could commit out of order."""
        if len(locked) != len(wanted["buckets"]):
            raise ConfigurationError(
                f"the outbox key-lock table {self.table.fullname} lacks rows (found "
                f"{len(locked)} of the {len(wanted['buckets'])} buckets asked): run "
                "consumerdedup.install() (or `consumerdedup init-db`) to restore them"
            )
