"""What the outbox needs on MySQL and MariaDB beyond its table: made by ``install()``.

- ``<outbox>_key_locks``: ``BUCKETS`` rows, one per bucket of keys. ``Outbox.add`` row-locks
  its key's bucket until the transaction ends, so same-key producers commit in the order
  their rows were numbered (outbox.mysql says why not GET_LOCK).
- ``ix_<outbox>_relay_scan`` on (published_at, id): the relay's scan of unpublished rows
  in id order. PostgreSQL and SQLite use the partial index on id WHERE published_at IS
  NULL; MySQL has no partial index, and an index on id alone would walk every published
  row the pruner has not deleted yet, at each round. ``ix_<outbox>_relay_failing`` on
  (published_at, attempts, key): the failing rows that hold keys back.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    func,
    insert,
    inspect,
    select,
)

from ..db import catalog
from ..db.names import fit_name
from .columns import ID_LENGTH

BUCKETS = 4096
"""Rows of the key-lock table: producers of two keys in one bucket wait on each other."""


def key_locks_table(outbox: Table) -> Table:
    """``<outbox>_key_locks`` in the outbox's schema, on a MetaData of its own (it exists on
    MySQL only: ``Tables.metadata.create_all`` elsewhere never makes it)."""
    return Table(
        fit_name("", outbox.name, "key_locks"),
        MetaData(),
        Column("bucket", Integer, primary_key=True, autoincrement=False),
        schema=outbox.schema,
        mysql_engine="InnoDB",
    )


def relay_indexes(outbox: Table) -> list[Index]:
    """On a stand-in of the outbox's columns (a MetaData of its own), so the outbox's Table,
    which every dialect's install() checks, never lists them: the scan's (published_at,
    id), and (published_at, attempts, key) for the few failing rows whose keys are held
    back (PostgreSQL's partial index ix_<outbox>_failing; without it MariaDB read the whole
    table at every round to find them, 7 ms a round at 3,000 rows)."""
    shadow = Table(
        outbox.name,
        MetaData(),
        Column("id", BigInteger, primary_key=True),
        Column("published_at", DateTime),
        Column("attempts", Integer),
        Column("key", String(ID_LENGTH)),
        schema=outbox.schema,
    )
    c = shadow.c
    return [
        Index(fit_name("ix_", outbox.name, "relay_scan"), c.published_at, c.id),
        Index(fit_name("ix_", outbox.name, "relay_failing"), c.published_at, c.attempts, c.key),
    ]


def install_outbox_extras(conn: Connection, outbox: Table) -> None:
    """Make what is missing: the key-lock table and its rows, the relay's scan index."""
    table = key_locks_table(outbox)
    if table.fullname not in catalog.existing(conn, [table]):
        table.create(conn)
    have = int(conn.execute(select(func.count()).select_from(table)).scalar_one())
    if have < BUCKETS:
        present = set(conn.execute(select(table.c.bucket)).scalars())
        missing = [{"bucket": b} for b in range(BUCKETS) if b not in present]
        for start in range(0, len(missing), 1000):
            conn.execute(insert(table), missing[start : start + 1000])
    names = {found["name"] for found in inspect(conn).get_indexes(outbox.name, outbox.schema)}
    for index in relay_indexes(outbox):
        if index.name not in names:
            index.create(conn)
