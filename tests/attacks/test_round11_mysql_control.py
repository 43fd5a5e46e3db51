"""Round 11 attacks on MySQL/MariaDB: transaction control a handler sends as SQL text in a
MySQL spelling, and statements that commit implicitly.

On PostgreSQL, DDL is transactional and every spelling of COMMIT is refused before it is
sent. On MySQL the guard read SQL text as PostgreSQL and SQLite read it, so:

- ``/*!COMMIT*/`` (a comment whose text the server runs), ``# note`` newline ``COMMIT``,
  ``SET STATEMENT .. FOR COMMIT`` and ``EXECUTE IMMEDIATE 'COMMIT'`` reached the server;
- DDL, ``LOCK TABLES``, ``SET autocommit=1`` commit the transaction implicitly (DDL even
  when it then fails), and were not refused at all.

The claim and the handler's earlier writes committed; the guard saw the transaction over
after the statement and deleted the claim, so the retry wrote them again (FAILED with the
effects twice), or a failing DDL's implicit commit left the record 'processed' for a
message reported FAILED and then DUPLICATE; ``LOCK TABLES`` stayed on the pooled
connection. Each is now refused before it is sent: FAILED, its record, no effects.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from consumerdedup import Deduplicator, Message, Outcome
from tests.conftest import Database
from tests.support.flavors import SWALLOW, AsyncFlavor, SyncFlavor

STATEMENTS = [
    "/*!COMMIT*/",
    "/*M!100000 COMMIT */",
    "# a note\nCOMMIT",
    "/*!ROLLBACK*/",
    "SET STATEMENT max_statement_time=100 FOR COMMIT",
    "EXECUTE IMMEDIATE 'COMMIT'",
    "CREATE TABLE {other} (a INT)",
    "/*!50000 CREATE TABLE {other} (a INT) */",
    "CREATE TABLE {keep} (a INT)",  # fails (exists), and commits before it fails
    "ALTER TABLE {keep} ADD COLUMN b INT",
    "DROP TABLE {keep}",
    "TRUNCATE TABLE {keep}",
    "RENAME TABLE {keep} TO {other}",
    "CREATE INDEX ix_a ON {keep} (a)",
    "LOCK TABLES {keep} WRITE",
    "SET autocommit = 1",
    "SET @@session.autocommit=1",
    "ANALYZE TABLE {keep}",
    "OPTIMIZE TABLE {keep}",
    "FLUSH TABLES",
    "CALL {proc}()",  # a MySQL procedure may COMMIT
]


@pytest.fixture(params=["sync", "async"])
def flavor(request: pytest.FixtureRequest, mariadb: Database) -> Iterator[Any]:
    chosen = SyncFlavor(mariadb) if request.param == "sync" else AsyncFlavor(mariadb)
    yield chosen
    chosen.close()


def rows(db: Database, sql: str) -> list[Any]:
    with db.engine.connect() as conn:
        return list(conn.execute(text(sql)).all())


@pytest.mark.parametrize("swallow", [False, True], ids=["raises", "swallows"])
@pytest.mark.parametrize("statement", STATEMENTS)
def test_a_statement_that_ends_the_transaction_is_refused_before_it_is_sent(
    flavor: Any, mariadb: Database, statement: str, swallow: bool
) -> None:
    """The handler writes, sends the statement (letting the refusal out, or swallowing
    it and writing again): FAILED, its record 'failed', and no effect at all."""
    ledger = mariadb.create_ledger()
    keep = mariadb.name("keep")
    other = mariadb.name(f"other_{uuid.uuid4().hex[:8]}")
    with mariadb.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {keep} (a INT)"))
        conn.execute(text(f"CREATE PROCEDURE {mariadb.name('commits')}() BEGIN COMMIT; END"))
    sql = statement.format(keep=keep, other=other, proc=mariadb.name("commits"))

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        insert = f"INSERT INTO {ledger} (message_id) VALUES (:m)"
        return [
            (insert, {"m": f"{message.id}-before"}),
            ((SWALLOW if swallow else "") + sql, {}),
            (insert, {"m": f"{message.id}-after"}),
        ]

    handle = flavor.wrap(behavior, consumer="c")
    result = handle(Message(id="m-1", body=b"x"))
    assert result is Outcome.FAILED
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == []
    records = rows(mariadb, f"SELECT message_id, outcome FROM {mariadb.name('processed_events')}")
    assert records == [("m-1", "failed")]
    # A redelivery finds the failure recorded (FAILED again, RecordedFailure): no effect.
    assert handle(Message(id="m-1", body=b"x")) is Outcome.FAILED
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == []
    # Nothing of the statement ran: the table is still there, unlocked, and as it was.
    assert rows(mariadb, f"SELECT count(*) FROM {keep}") == [(0,)]
    assert [r[0] for r in rows(mariadb, f"SHOW COLUMNS FROM {keep}")] == ["a"]


def test_a_temporary_table_does_not_commit_and_is_allowed(flavor: Any, mariadb: Database) -> None:
    """The negative control: CREATE/DROP TEMPORARY TABLE commit nothing on InnoDB, so a
    handler may use them (and `SET` of another variable, a string holding CREATE)."""
    ledger = mariadb.create_ledger()
    tmp = f"tmp_{uuid.uuid4().hex[:8]}"

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"CREATE TEMPORARY TABLE {tmp} (a INT)", {}),
            ("SET @note = 'CREATE TABLE x; COMMIT'", {}),
            (f"INSERT INTO {ledger} (message_id) VALUES ('CREATE TABLE y')", {}),
            (f"DROP TEMPORARY TABLE {tmp}", {}),
        ]

    handle = flavor.wrap(behavior, consumer="c")
    assert handle(Message(id="m-1", body=b"x")) is Outcome.PROCESSED
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == [("CREATE TABLE y",)]


SESSION_CHANGES = [
    "SET NAMES latin1",
    "SET CHARACTER SET latin1",
    "SET @@session.character_set_client = latin1",
    "SET SESSION TRANSACTION ISOLATION LEVEL READ UNCOMMITTED",
    "SET @@session.transaction_isolation = 'READ-UNCOMMITTED'",
    "USE mysql",
]


@pytest.mark.parametrize("statement", SESSION_CHANGES)
def test_a_session_change_later_messages_would_inherit_is_refused(
    mariadb: Database, statement: str
) -> None:
    """Before: ``SET NAMES latin1`` in one handler stayed on the pooled connection, and the
    next message there, 'é', was recorded as 'Ã©': its redelivery on another connection
    was no DUPLICATE and its effects applied twice. Now refused before it is sent (the
    character set, isolation and default database a pooled connection keeps)."""
    ledger = mariadb.create_ledger()
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "first":
            session.execute(text(statement))

    try:
        assert handle(Message(id="first", body=b"x")) is Outcome.FAILED
        assert handle(Message(id="\u00e9\U0001f600", body=b"x")) is Outcome.PROCESSED
    finally:
        engine.dispose()
    other = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables)
    again = other.handler(lambda m, s: s.execute(insert, {"m": m.id}))
    assert again(Message(id="\u00e9\U0001f600", body=b"x")) is Outcome.DUPLICATE
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == [("\u00e9\U0001f600",)]


MULTI = [
    'SELECT "a\\""; COMMIT; SELECT 1 -- "',  # a backslash-escaped quote in "...": MySQL's lexer
    "SELECT 'a\\''; COMMIT; SELECT 1 -- '",
    "SELECT 1 --x\n; COMMIT",  # '--x' is no comment on MySQL
    "SELECT 1; /*!COMMIT*/",
    "SELECT 1 # it's a comment\n; COMMIT",
]


@pytest.mark.parametrize("statement", MULTI)
def test_multi_statement_text_is_read_as_mysql_reads_it(mariadb: Database, statement: str) -> None:
    """With CLIENT.MULTI_STATEMENTS (an engine's connect_args), one text may hold several
    statements: where MySQL's lexer ends a string or a comment decides whether a COMMIT
    hides in it. Refused before it is sent, whichever way the server reads it."""
    from pymysql.constants import CLIENT

    ledger = mariadb.create_ledger()
    flags = CLIENT.MULTI_STATEMENTS | CLIENT.FOUND_ROWS
    engine = create_engine(mariadb.url, connect_args={"client_flag": flags})
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        session.connection().exec_driver_sql(statement)
        raise RuntimeError("the handler fails after it")

    try:
        assert handle(Message(id="m-1", body=b"x")) is Outcome.FAILED
    finally:
        engine.dispose()
    assert rows(mariadb, f"SELECT message_id FROM {ledger}") == []


def test_an_sql_mode_a_handler_leaves_on_the_connection_keeps_keys_exact(
    mariadb: Database,
) -> None:
    """Held: sql_mode stays on the pooled connection (NO_BACKSLASH_ESCAPES, ANSI_QUOTES,
    PAD_CHAR_TO_FULL_LENGTH), and the next messages' ids with quotes and backslashes are
    still recorded byte for byte (PyMySQL escapes by the server's flags): their
    redeliveries on a clean connection are DUPLICATE."""
    ledger = mariadb.create_ledger()
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)
    modes = "',NO_BACKSLASH_ESCAPES,ANSI_QUOTES,PAD_CHAR_TO_FULL_LENGTH'"

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "first":
            session.execute(text(f"SET SESSION sql_mode = CONCAT(@@sql_mode, {modes})"))

    ids = ["a'b\\c\"d", "x\\'; --", "tail "]
    try:
        assert handle(Message(id="first", body=b"x")) is Outcome.PROCESSED
        assert handle.batch([Message(id=i, body=b"x") for i in ids]) == [Outcome.PROCESSED] * 3
    finally:
        engine.dispose()
    other = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables)
    again = other.handler(lambda m, s: s.execute(insert, {"m": m.id}))
    assert again.batch([Message(id=i, body=b"x") for i in ids]) == [Outcome.DUPLICATE] * 3
    assert sorted(r[0] for r in rows(mariadb, f"SELECT message_id FROM {ledger}")) == sorted(
        ["first", *ids]
    )
