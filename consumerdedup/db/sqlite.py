"""Make our transactions on SQLite real from their first statement, without touching the engine.

By default the sqlite3 module (and aiosqlite over it) sends BEGIN only before
INSERT, UPDATE or DELETE. A transaction that starts with a SELECT or a
SAVEPOINT is then no transaction: a read-then-write is not isolated, and a
SAVEPOINT opens a transaction of its own that its RELEASE commits (a handler's
``session.begin_nested()`` would commit its writes ahead of the dedup record).

SQLAlchemy documents a fix that hooks the engine ("connect" and "begin"). We
do not install it: the application's engine is its own, it may already carry
that recipe (a second BEGIN would fail every transaction), and sessions may
come from the application's own ``session_factory``. Instead, once SQLAlchemy
has begun one of our transactions, we ask the driver whether it is really in
one; if not, we send ``BEGIN IMMEDIATE``. IMMEDIATE takes the write lock up
front, because every dedup transaction writes: concurrent writers then wait on
the busy timeout instead of failing on a lock upgrade. If the engine already
sent a BEGIN of its own (the recipe, or ``autocommit=False`` on Python 3.12+),
that transaction is used as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Connection


def begin_immediate(conn: Connection) -> None:
    """After SQLAlchemy began ``conn``'s transaction: make sure SQLite did too."""
    if conn.dialect.name != "sqlite":
        return
    if not conn.connection.driver_connection.in_transaction:  # type: ignore[union-attr]
        conn.exec_driver_sql("BEGIN IMMEDIATE")


@contextmanager
def transaction(conn: Connection) -> Iterator[Connection]:
    """``conn.begin()`` that is a real, write-locked transaction on SQLite."""
    with conn.begin():
        begin_immediate(conn)
        yield conn
