"""The start check on MySQL/MariaDB's binary log, live (issue 34): a READ COMMITTED
session whose binary log is in STATEMENT format is refused before any message is
decided, because InnoDB refuses every write there (error 1665); the same session
without a binary log works, and is not refused.

``log_bin`` is read only at server start and the shared test server runs without it
(``log_bin=OFF``, where a STATEMENT session writes freely: no binary log, nothing to
refuse). So the refusal runs on a private MariaDB started with ``--log-bin``
(tests/support/private_mariadb.py), and the session is put in STATEMENT format by the
driver's ``init_command`` (``SET SESSION binlog_format``, as a server default or a
connection pool's init command would); the shared server shows the other half.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    install,
)
from consumerdedup.db import mysql_errors
from consumerdedup.schema import Tables
from tests.conftest import Database
from tests.support import mariadb_service
from tests.support.private_mariadb import private_mariadb

STATEMENT = {"init_command": "SET SESSION binlog_format = 'STATEMENT'"}
REFUSED = r"READ COMMITTED and the binary log is in STATEMENT format.*error 1665.*binlog_format=ROW"


@pytest.fixture(scope="module")
def binlog_url() -> Iterator[str]:
    """A private MariaDB with the binary log on (MIXED, the default format)."""
    with private_mariadb(["--log-bin=binlog", "--server-id=1"]) as url:
        yield url


def prepared(url: str) -> tuple[Tables, str]:
    """The library's tables and a ledger, installed by an ordinary session."""
    engine = create_engine(url)
    tables = Tables.define()
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS ledger (message_id VARCHAR(64))"))
    engine.dispose()
    return tables, "ledger"


def count(url: str, sql: str) -> int:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())
    finally:
        engine.dispose()


def deduplicator(engine: Engine, tables: Tables, ledger: str) -> Any:
    dedup = Deduplicator(engine, consumer="binlog", tables=tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": message.id})

    return handle


def test_the_server_refuses_every_write_there(binlog_url: str) -> None:
    """What the check protects against, shown on the server itself: in that session an
    InnoDB write fails with 1665, whatever it is."""
    _, ledger = prepared(binlog_url)
    engine = create_engine(binlog_url, isolation_level="READ COMMITTED", connect_args=STATEMENT)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT @@SESSION.binlog_format, @@GLOBAL.log_bin")).one() == (
                "STATEMENT",
                1,
            )
            with pytest.raises(OperationalError) as refused:
                conn.execute(text(f"INSERT INTO {ledger} VALUES ('x')"))
            assert mysql_errors.errno(refused.value) == 1665
    finally:
        engine.dispose()


def test_read_committed_with_a_statement_binlog_is_refused_before_any_decision(
    binlog_url: str,
) -> None:
    """ConfigurationError naming the fix, raised to the caller (a setup fault stops the
    runner): no record, no effect, nothing FAILED."""
    tables, ledger = prepared(binlog_url)
    engine = create_engine(binlog_url, isolation_level="READ COMMITTED", connect_args=STATEMENT)
    try:
        handle = deduplicator(engine, tables, ledger)
        with pytest.raises(ConfigurationError, match=REFUSED):
            handle(Message(id="refused-1", body=b"x"))
    finally:
        engine.dispose()
    assert count(binlog_url, "SELECT count(*) FROM processed_events") == 0
    assert count(binlog_url, f"SELECT count(*) FROM {ledger} WHERE message_id = 'refused-1'") == 0


def test_an_async_session_is_refused_alike(binlog_url: str) -> None:
    tables, ledger = prepared(binlog_url)

    async def main() -> None:
        engine = create_async_engine(
            mariadb_service.async_url(binlog_url),
            isolation_level="READ COMMITTED",
            connect_args=STATEMENT,
        )
        dedup = AsyncDeduplicator(engine, consumer="binlog", tables=tables)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(text(f"INSERT INTO {ledger} VALUES (:m)"), {"m": message.id})

        try:
            with pytest.raises(ConfigurationError, match=REFUSED):
                await handle(Message(id="refused-2", body=b"x"))
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert count(binlog_url, "SELECT count(*) FROM processed_events") == 0


@pytest.mark.parametrize(
    ("isolation", "init"),
    [
        ("REPEATABLE READ", STATEMENT),  # STATEMENT is fine outside READ COMMITTED
        ("READ COMMITTED", {"init_command": "SET SESSION binlog_format = 'ROW'"}),
        ("READ COMMITTED", {}),  # the server's MIXED
    ],
    ids=["repeatable-read-statement", "read-committed-row", "read-committed-mixed"],
)
def test_what_can_work_with_the_binlog_on_is_not_refused(
    binlog_url: str, isolation: str, init: dict[str, str]
) -> None:
    tables, ledger = prepared(binlog_url)
    engine = create_engine(binlog_url, isolation_level=isolation, connect_args=init)
    message = Message(id=f"ok-{uuid.uuid4().hex[:12]}", body=b"x")
    try:
        handle = deduplicator(engine, tables, ledger)
        assert handle(message) is Outcome.PROCESSED
        assert handle(message) is Outcome.DUPLICATE
    finally:
        engine.dispose()
    where = f"WHERE message_id = '{message.id}'"
    assert count(binlog_url, f"SELECT count(*) FROM {ledger} {where}") == 1


def test_without_a_binary_log_a_statement_session_works(mariadb: Database) -> None:
    """The shared server runs with log_bin=OFF: a READ COMMITTED session in STATEMENT
    format writes freely there (nothing is logged), so it is not refused."""
    ledger = mariadb.create_ledger()
    engine = create_engine(mariadb.url, isolation_level="READ COMMITTED", connect_args=STATEMENT)
    try:
        with engine.connect() as conn:
            said = conn.execute(text("SELECT @@SESSION.binlog_format, @@GLOBAL.log_bin")).one()
            if said[1]:
                pytest.skip("this server has the binary log on: the private server's case")
            assert said[0] == "STATEMENT"
        dedup = Deduplicator(engine, consumer="binlog", tables=mariadb.tables)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            session.execute(
                text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id}
            )

        assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    finally:
        engine.dispose()
    assert mariadb.scalar(f"SELECT count(*) FROM {ledger}") == 1
