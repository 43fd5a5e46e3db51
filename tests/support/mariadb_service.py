"""The MariaDB (or MySQL) server the integration tests talk to, and per-test isolation on it.

Order, as for PostgreSQL (services.postgres_url): an explicit URL in
``CONSUMERDEDUP_TEST_MYSQL_URL`` (a ``mysql+pymysql://`` URL; its database is only where
the test databases are created from); else the local default 127.0.0.1:3306 (root, empty
password) if it answers; else skip with the reason (a failure in CI).

Isolation: on MySQL a schema is a database, so each test gets a database of its own,
``t_<12 hex>``, and names its tables ``t_xxx.processed_events`` (Tables.define takes
schema-qualified names), exactly as the PostgreSQL fixtures use a schema per test. The
database is dropped afterwards, whatever the test did.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.support import services

MYSQL_DEFAULT = "mysql+pymysql://root@127.0.0.1:3306/test"
URL_VARIABLE = "CONSUMERDEDUP_TEST_MYSQL_URL"
ASYNC_DRIVER = "aiomysql"


def mariadb_url() -> str:
    """A SQLAlchemy URL (PyMySQL driver) of a MariaDB/MySQL server the tests may use."""
    url = os.environ.get(URL_VARIABLE)
    if url:
        return url
    if services.answers("127.0.0.1", 3306):
        return MYSQL_DEFAULT
    services.unavailable(
        f"no MariaDB/MySQL: set {URL_VARIABLE} (mysql+pymysql://user:password@host/db) or "
        "start one on 127.0.0.1:3306 (.ci/run starts /usr/sbin/mariadbd)"
    )


def in_database(url: str, database: str) -> str:
    """``url`` pointed at ``database`` (rendered with its password, for create_engine)."""
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def async_url(url: str) -> str:
    """The same server and database through the asyncio driver."""
    return (
        make_url(url).set(drivername=f"mysql+{ASYNC_DRIVER}").render_as_string(hide_password=False)
    )


@contextlib.contextmanager
def isolated_database(url: str) -> Iterator[str]:
    """A new, empty database (utf8mb4) nobody else uses; yields its name; dropped after."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(url, poolclass=None)
    try:
        with admin.begin() as conn:
            conn.execute(text(f"CREATE DATABASE `{name}` CHARACTER SET utf8mb4"))
        yield name
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{name}`"))
        admin.dispose()
