"""The SQL the hand-written baselines send: what the pipeline sends, without SQLAlchemy.

A claim is one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` of the batch's ids into the
same processed_events the pipeline uses (under another consumer name): what comes back was
claimed by this transaction, the rest were there already (duplicates).

MariaDB/MySQL (bench_mysql, bench_mysql_relay, profile_mysql): the server to use
(``MYSQL_URL``), a database of the run's own (``mysql_database``), the server's settings in
the conditions (``describe_mysql``) and the plain PyMySQL connection (``plain_mysql``).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from measure import Conditions, commit_latency
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.orm import Session

from consumerdedup import Message

MYSQL_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"
)
MYSQL_SETTINGS = (
    "version",
    "innodb_flush_log_at_trx_commit",
    "sync_binlog",
    "log_bin",
    "binlog_format",
    "innodb_buffer_pool_size",
)


def claim_many(processed_events: str) -> str:
    """Parameters: consumer, the ids (a list), their payload hashes (a list)."""
    return (
        f"INSERT INTO {processed_events} (consumer, message_id, processed_at, payload_hash, "
        "outcome, error) SELECT %s, m, now(), h, 'processed', NULL "
        "FROM unnest(%s::varchar[], %s::varchar[]) AS t(m, h) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )


def claim_by_hand(session: Session, processed_events: str, part: Sequence[Message]) -> set[str]:
    """The multi-row claim of ``part`` written by hand through a plain SQLAlchemy Session
    (consumer 'hand'): the ids it claimed. The ceilings' claim."""
    claim = text(
        f"INSERT INTO {processed_events} (consumer, message_id, processed_at, payload_hash, "
        "outcome, error) SELECT 'hand', m, now(), h, 'processed', NULL "
        "FROM unnest(CAST(:ids AS varchar[]), CAST(:hashes AS varchar[])) AS t(m, h) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )
    params = {"ids": [m.id for m in part], "hashes": hashes(m.body for m in part)}
    return set(session.execute(claim, params).scalars())


def hashes(bodies: Iterable[bytes]) -> list[str]:
    """sha256 hex of each body, as the pipeline records it."""
    return [hashlib.sha256(body).hexdigest() for body in bodies]


@contextmanager
def mysql_database(prefix: str = "bench") -> Iterator[tuple[Any, Any]]:
    """A database of its own on the server at MYSQL_URL: (its engine, its URL); dropped at
    the end."""
    database = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(MYSQL_URL)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE DATABASE `{database}` CHARACTER SET utf8mb4"))
    url = make_url(MYSQL_URL).set(database=database)
    engine = create_engine(url)
    try:
        yield engine, url
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{database}`"))
        admin.dispose()


def describe_mysql(conditions: Conditions, engine: Any) -> None:
    """The server's version and durability settings, and what one commit costs."""
    import pymysql

    with engine.connect() as conn:
        found = {n: str(conn.exec_driver_sql(f"SELECT @@{n}").scalar()) for n in MYSQL_SETTINGS}
    conditions.add(
        "server",
        f"{found['version']} on this machine: innodb_flush_log_at_trx_commit="
        f"{found['innodb_flush_log_at_trx_commit']} sync_binlog={found['sync_binlog']} "
        f"log_bin={found['log_bin']} binlog_format={found['binlog_format']} "
        f"innodb_buffer_pool_size={int(found['innodb_buffer_pool_size']) // 2**20} MiB",
    )
    conditions.add("PostgreSQL", "not used (synchronous_commit= n/a): MariaDB/MySQL only")
    conditions.add(
        "  commit",
        f"{commit_latency(engine):.2f} ms for one write transaction alone (median of 50: a "
        "round trip and a redo-log flush: the floor under every per-transaction figure)",
    )
    conditions.add("PyMySQL", pymysql.VERSION_STRING)


def plain_mysql(url: Any) -> Any:
    """A PyMySQL connection of its own to ``url``'s database, autocommit off."""
    import pymysql

    return pymysql.connect(
        host=url.host or "127.0.0.1",
        port=url.port or 3306,
        user=url.username or "root",
        password=url.password or "",
        database=url.database,
        autocommit=False,
    )
