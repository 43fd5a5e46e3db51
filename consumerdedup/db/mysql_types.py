"""Column types that make MySQL and MariaDB store our keys and times as PostgreSQL does.

Keys: the server's default utf8mb4 collation is case- and accent-insensitive and
(PAD SPACE) ignores trailing spaces, so message ids ``"A1"`` and ``"a1 "`` would be one
key: the second message would be reported DUPLICATE and its effects lost. Our key
columns use a binary NO PAD collation, byte-for-byte equality: ``utf8mb4_nopad_bin`` on
MariaDB, ``utf8mb4_0900_bin`` on MySQL 8 (both NO PAD; ``utf8mb4_bin`` pads).

Times: DATETIME holds no time zone and, without a precision, no fraction of a second.
``UtcDateTime`` stores microseconds in UTC and reads them back as aware UTC datetimes,
independent of the session's ``time_zone`` (we never use the server's clock).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import String
from sqlalchemy.dialects import mysql
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.types import TypeDecorator

MYSQL = ("mysql", "mariadb")
"""SQLAlchemy's names for the two (``mariadb://`` URLs name the second)."""

MARIADB_KEY_COLLATION = "utf8mb4_nopad_bin"
MYSQL_KEY_COLLATION = "utf8mb4_0900_bin"


class KeyString(String):
    """VARCHAR(n) in utf8mb4 with a binary NO PAD collation (see the module's doc)."""

    cache_ok = True


def key_collation(dialect: Any) -> str:
    return MARIADB_KEY_COLLATION if getattr(dialect, "is_mariadb", False) else MYSQL_KEY_COLLATION


@compiles(KeyString, "mysql")
@compiles(KeyString, "mariadb")
def _key_ddl(type_: KeyString, compiler: Any, **kw: Any) -> str:
    return (
        f"VARCHAR({type_.length}) CHARACTER SET utf8mb4 COLLATE {key_collation(compiler.dialect)}"
    )


class UtcDateTime(TypeDecorator[datetime]):
    """DATETIME(6) holding UTC: aware datetimes in (converted to UTC), aware UTC out."""

    impl = mysql.DATETIME(fsp=6)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None or value.tzinfo is None:
            return value
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None or value.tzinfo is not None:
            return value
        return value.replace(tzinfo=UTC)
