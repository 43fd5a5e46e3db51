"""The core on MySQL/MariaDB (InnoDB): the claim, the guard, the server checks, install().

What InnoDB changes (docs/databases.md): no ON CONFLICT and no RETURNING (the claim is a
plain INSERT whose 1062 means DUPLICATE), a deadlock rolls back the WHOLE transaction
and the next statement silently opens a new one, other errors undo their statement
alone. Every test runs on the real MariaDB, in a database of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    RetryPolicy,
    install,
)
from consumerdedup.db import dialects, mysql_errors
from consumerdedup.schema import Tables, ddl
from tests.conftest import Database
from tests.support.flavors import SWALLOW, AsyncFlavor, SyncFlavor

FAST_RETRY = RetryPolicy(attempts=8, initial_delay=timedelta(milliseconds=5))


@pytest.fixture(params=["sync", "async"])
def flavor(request: pytest.FixtureRequest, mariadb: Database) -> Iterator[Any]:
    chosen = SyncFlavor(mariadb) if request.param == "sync" else AsyncFlavor(mariadb)
    yield chosen
    chosen.close()


def rows(db: Database, sql: str) -> list[Any]:
    with db.engine.connect() as conn:
        return list(conn.execute(text(sql)).all())


def ledger_ids(db: Database, ledger: str) -> list[str]:
    return sorted(r[0] for r in rows(db, f"SELECT message_id FROM {ledger}"))


def insert_ledger(ledger: str) -> Callable[[Message], list[tuple[str, dict[str, Any]]]]:
    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]

    return behavior


# The claim -----------------------------------------------------------------------------------


def test_a_claim_and_a_duplicate_are_told_apart(flavor: Any, mariadb: Database) -> None:
    """Within a batch, across batches, and one by one: each id applied once."""
    ledger = mariadb.create_ledger()
    handle = flavor.wrap(insert_ledger(ledger), consumer="c")
    m = [Message(id=i, body=b"x") for i in ("a", "b", "c", "d")]
    assert handle(m[0]) is Outcome.PROCESSED
    assert handle.batch([m[0], m[1], m[0], m[2]]) == [
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
    ]
    assert handle.batch([m[3], m[2], m[1]]) == [
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
    ]
    assert ledger_ids(mariadb, ledger) == ["a", "b", "c", "d"]
    assert len(rows(mariadb, f"SELECT 1 FROM {mariadb.name('processed_events')}")) == 4


def test_found_rows_makes_a_no_op_upsert_blind(mariadb: Database) -> None:
    """Why the claim is no ON DUPLICATE KEY UPDATE: SQLAlchemy's MySQL dialects connect
    with CLIENT.FOUND_ROWS, so a no-op upsert counts 1 whether it inserted or found."""
    pe = mariadb.name("processed_events")
    upsert = text(
        f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
        "VALUES ('c', 'k', NOW(6), 'h', 'processed') "
        "ON DUPLICATE KEY UPDATE outcome = outcome"
    )
    with mariadb.engine.begin() as conn:
        inserted = conn.execute(upsert).rowcount
        found = conn.execute(upsert).rowcount
    assert inserted == found == 1


def test_keys_are_compared_byte_for_byte(flavor: Any, mariadb: Database) -> None:
    """The server's default collation would make these one key (case, accents, trailing
    spaces): each is its own message."""
    ledger = mariadb.create_ledger()
    handle = flavor.wrap(insert_ledger(ledger), consumer="c")
    ids = [
        "key",
        "KEY",
        "key ",
        "kéy",
        "k\u00e9y".upper(),
        "\uff4b\uff45\uff59",
    ]  # the last: fullwidth
    assert handle.batch([Message(id=i, body=b"x") for i in ids]) == [Outcome.PROCESSED] * 6
    assert handle.batch([Message(id=i, body=b"x") for i in ids]) == [Outcome.DUPLICATE] * 6
    assert sorted(ledger_ids(mariadb, ledger)) == sorted(ids)


def test_the_longest_id_in_four_byte_characters_is_a_key(mariadb: Database) -> None:
    """255 characters of 4 bytes each in the (consumer, message_id) primary key: within
    InnoDB's 3,072-byte index limit."""
    ledger = mariadb.create_ledger()
    handle = SyncFlavor(mariadb).wrap(insert_ledger(ledger), consumer="c" * 255)
    long_id = "\U0001f600" * 255
    assert handle(Message(id=long_id, body=b"x")) is Outcome.PROCESSED
    assert handle(Message(id=long_id, body=b"x")) is Outcome.DUPLICATE
    assert ledger_ids(mariadb, ledger) == [long_id]


def test_check_first_is_refused(mariadb: Database) -> None:
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables)
    with pytest.raises(ConfigurationError, match="claim_first=False on MySQL"):

        @dedup.handler(claim_first=False)
        def handle(message: Message, session: Any) -> None:
            return None

        handle(Message(id="a", body=b"x"))


# Statement-level errors a handler swallows: the statement alone was undone ----------------


def test_a_swallowed_duplicate_key_undoes_its_statement_alone(
    flavor: Any, mariadb: Database
) -> None:
    """MySQL's 1062 in the handler's own INSERT undoes that statement only, as a savepoint
    would (PostgreSQL would abort the transaction): the rest of the handler commits."""
    keyed = mariadb.name("keyed")
    with mariadb.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {keyed} (k VARCHAR(16) PRIMARY KEY)"))
        conn.execute(text(f"INSERT INTO {keyed} VALUES ('taken')"))

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"{SWALLOW}INSERT INTO {keyed} VALUES ('taken')", {}),
            (f"INSERT INTO {keyed} VALUES (:m)", {"m": message.id}),
        ]

    handle = flavor.wrap(behavior, consumer="c")
    assert handle(Message(id="m-1", body=b"x")) is Outcome.PROCESSED
    assert sorted(r[0] for r in rows(mariadb, f"SELECT k FROM {keyed}")) == ["m-1", "taken"]
    assert handle(Message(id="m-1", body=b"x")) is Outcome.DUPLICATE


def test_a_swallowed_data_too_long_undoes_its_statement_alone(
    flavor: Any, mariadb: Database
) -> None:
    """1406 (strict mode, the server's default): the too-long row is absent, the rest is in."""
    short = mariadb.name("short")
    with mariadb.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {short} (v VARCHAR(4))"))

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        return [
            (f"{SWALLOW}INSERT INTO {short} VALUES ('far too long')", {}),
            (f"INSERT INTO {short} VALUES ('ok')", {}),
        ]

    handle = flavor.wrap(behavior, consumer="c")
    assert handle(Message(id="m-1", body=b"x")) is Outcome.PROCESSED
    assert rows(mariadb, f"SELECT v FROM {short}") == [("ok",)]


# A deadlock rolls back the whole transaction --------------------------------------------------


class Deadlocker:
    """Makes the handler's transaction the victim of a real InnoDB deadlock.

    Another transaction (a thread) takes row 2 after writing many rows, then asks for
    row 1, which the handler holds; the handler asks for row 2. Whichever request comes
    second closes the cycle, and InnoDB rolls back the lighter transaction: the
    handler's (its claim and a row or two against the other's 200), error 1213.
    """

    def __init__(self, db: Database) -> None:
        self.db = db
        self.locks = db.name("locks")
        self.heavy = db.name("heavy")
        with db.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.locks} (id INT PRIMARY KEY, n INT)"))
            conn.execute(text(f"INSERT INTO {self.locks} VALUES (1, 0), (2, 0)"))
            conn.execute(text(f"CREATE TABLE {self.heavy} (id INT PRIMARY KEY)"))
        self.other = create_engine(db.url, poolclass=None)
        self.holding = threading.Event()
        self.thread: threading.Thread | None = None
        self.other_id: int | None = None
        self.errors: list[BaseException] = []

    def start_other(self) -> None:
        """The other transaction: heavy, holds row 2, then waits for row 1."""

        def run() -> None:
            try:
                with self.other.begin() as conn:
                    self.other_id = conn.execute(text("SELECT CONNECTION_ID()")).scalar()
                    conn.execute(
                        text(f"INSERT INTO {self.heavy} VALUES (:i)"),
                        [{"i": i} for i in range(200)],
                    )
                    conn.execute(text(f"UPDATE {self.locks} SET n = n + 1 WHERE id = 2"))
                    self.holding.set()
                    conn.execute(text(f"UPDATE {self.locks} SET n = n + 1 WHERE id = 1"))
                    conn.rollback()
            except BaseException as exc:  # surfaced by join()
                self.errors.append(exc)
                self.holding.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert self.holding.wait(10)

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(20)
        assert not self.thread.is_alive()
        assert not self.errors, self.errors
        self.other.dispose()

    def first_half(self) -> str:
        return f"UPDATE {self.locks} SET n = n + 1 WHERE id = 1"

    def second_half(self) -> str:
        return f"UPDATE {self.locks} SET n = n + 1 WHERE id = 2"


def is_deadlock(error: BaseException) -> bool:
    return mysql_errors.errno(error) == mysql_errors.DEADLOCK


def test_a_handler_that_swallows_a_deadlock_is_never_processed_with_partial_effects(
    mariadb: Database,
) -> None:
    """Attempt 1 writes 'before', is rolled back whole by the deadlock, catches it and
    writes 'after' (which would commit in a new transaction with no record). The guard
    ends that attempt at the deadlock; the retry runs clean: exactly its effects."""
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        attempt = f"{message.id}-{len(seen) + 1}"
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": attempt})
        if not seen:
            session.execute(text(deadlocker.first_half()))
            deadlocker.start_other()
            try:
                session.execute(text(deadlocker.second_half()))
            except OperationalError as exc:
                seen.append("deadlock" if is_deadlock(exc) else repr(exc))
                with pytest.raises(DBAPIError):  # and it is told at the next statement
                    session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('after')"))
                return
        seen.append("clean")

    assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    deadlocker.join()
    assert seen == ["deadlock", "clean"]
    assert ledger_ids(mariadb, ledger) == ["m-2"]  # nothing of attempt 1: not even 'before'
    assert handle(Message(id="m", body=b"x")) is Outcome.DUPLICATE


def test_a_deadlock_the_guard_cannot_see_is_caught_by_the_claim_check(
    mariadb: Database,
) -> None:
    """The same, on the raw DB-API connection, where no SQLAlchemy event sees the 1213:
    the last statement before COMMIT finds the attempt's claim gone (InnoDB rolled it
    back with the rest) and nothing of the new transaction commits."""
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        raw = session.connection().connection.driver_connection
        cursor = raw.cursor()
        insert = f"INSERT INTO {ledger} (message_id) VALUES (%s)"
        cursor.execute(insert, (f"{message.id}-{len(seen) + 1}",))
        if not seen:
            cursor.execute(deadlocker.first_half())
            deadlocker.start_other()
            try:
                cursor.execute(deadlocker.second_half())
            except Exception as exc:  # swallowed, below the guard
                seen.append("deadlock" if is_deadlock(exc) else repr(exc))
            cursor.execute(insert, ("after",))  # opens a new transaction, silently
            return
        seen.append("clean")

    assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    deadlocker.join()
    assert seen == ["deadlock", "clean"]
    assert ledger_ids(mariadb, ledger) == ["m-2"]


def test_an_async_handler_that_swallows_a_deadlock_is_never_processed(
    mariadb: Database,
) -> None:
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []

    async def main() -> tuple[Outcome, Outcome]:
        engine = mariadb.async_engine()
        dedup = AsyncDeduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            attempt = f"{message.id}-{len(seen) + 1}"
            insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
            await session.execute(insert, {"m": attempt})
            if not seen:
                await session.execute(text(deadlocker.first_half()))
                await asyncio.to_thread(deadlocker.start_other)
                try:
                    await session.execute(text(deadlocker.second_half()))
                except OperationalError as exc:
                    seen.append("deadlock" if is_deadlock(exc) else repr(exc))
                    with contextlib.suppress(DBAPIError):
                        await session.execute(insert, {"m": "after"})
                    return
            seen.append("clean")

        try:
            first = await handle(Message(id="m", body=b"x"))
            again = await handle(Message(id="m", body=b"x"))
            return first, again
        finally:
            await engine.dispose()

    assert asyncio.run(main()) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    deadlocker.join()
    assert seen == ["deadlock", "clean"]
    assert ledger_ids(mariadb, ledger) == ["m-2"]


# Racing twins ---------------------------------------------------------------------------------


def test_a_duplicate_key_storm_whose_first_inserter_rolls_back(mariadb: Database) -> None:
    """A transaction holds the key's claim uncommitted; six deliveries of that key wait on
    its lock; it rolls back. The waiters' gap locks may deadlock each other (1213: the
    victim is retried); in the end one is PROCESSED, the rest DUPLICATE, applied once."""
    ledger = mariadb.create_ledger()
    pe = mariadb.name("processed_events")
    twins = 6
    engine = create_engine(mariadb.url, pool_size=twins + 2)
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)
    calls: list[str] = []

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        calls.append(message.id)
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})

    holder = engine.connect()
    holder.execute(
        text(
            f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
            "VALUES ('c', 'storm', NOW(6), 'h', 'processed')"
        )
    )
    outcomes: list[Outcome] = []
    threads = [
        threading.Thread(
            target=lambda: outcomes.append(handle(Message(id="storm", body=b"x"))), daemon=True
        )
        for _ in range(twins)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    # Each twin's INSERT shows in the process list while it waits on the holder's key (one
    # that does not wait is done in microseconds); information_schema.innodb_trx was no
    # help: MariaDB 10.11 showed waiters there as RUNNING for seconds.
    waiting = text(
        "SELECT count(*) FROM information_schema.processlist "
        "WHERE command = 'Query' AND info LIKE :q"
    )
    with engine.connect() as watch:
        while watch.execute(waiting, {"q": f"INSERT INTO {pe}%"}).scalar() < twins:
            assert time.monotonic() < deadline, "the twins never all waited on the key"
            watch.rollback()
    holder.rollback()
    holder.close()
    for thread in threads:
        thread.join(30)
    engine.dispose()
    assert Counter(outcomes) == Counter({Outcome.PROCESSED: 1, Outcome.DUPLICATE: twins - 1})
    assert calls == ["storm"]
    assert ledger_ids(mariadb, ledger) == ["storm"]


# The server and session checks ----------------------------------------------------------------


def test_read_uncommitted_is_refused_naming_the_fix(mariadb: Database) -> None:
    engine = create_engine(mariadb.url, isolation_level="READ UNCOMMITTED")
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        return None

    try:
        with pytest.raises(ConfigurationError, match=r"READ UNCOMMITTED.*REPEATABLE READ"):
            handle(Message(id="a", body=b"x"))
    finally:
        engine.dispose()
    assert rows(mariadb, f"SELECT 1 FROM {mariadb.name('processed_events')}") == []


def test_read_committed_works(mariadb: Database) -> None:
    """With the binary log off (or in ROW/MIXED format) READ COMMITTED can write."""
    engine = create_engine(mariadb.url, isolation_level="READ COMMITTED")
    ledger = mariadb.create_ledger()
    handle = SyncFlavor(SimpleNamespace(engine=engine, tables=mariadb.tables)).wrap(
        insert_ledger(ledger), consumer="c"
    )
    try:
        assert handle(Message(id="a", body=b"x")) is Outcome.PROCESSED
        assert handle(Message(id="a", body=b"x")) is Outcome.DUPLICATE
    finally:
        engine.dispose()
    assert ledger_ids(mariadb, ledger) == ["a"]


def test_an_autocommit_engine_is_refused(mariadb: Database) -> None:
    engine = create_engine(mariadb.url, isolation_level="AUTOCOMMIT")
    try:
        with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            Deduplicator(engine, consumer="c", tables=mariadb.tables)
    finally:
        engine.dispose()


@pytest.mark.parametrize("driver", ["mysqldb", "mysqlconnector", "asyncmy", "mariadbconnector"])
def test_other_mysql_drivers_are_refused_with_the_supported_list(driver: str) -> None:
    dialect = SimpleNamespace(name="mysql", driver=driver)
    with pytest.raises(ConfigurationError, match=r"mysql\+pymysql, mysql\+aiomysql"):
        dialects.require_driver(dialect, "Deduplicator")


# install() ------------------------------------------------------------------------------------


def test_install_refuses_a_connection_inside_a_transaction(mariadb: Database) -> None:
    """DDL commits implicitly on MySQL: the caller's half-done work would commit."""
    ledger = mariadb.create_ledger()
    tables = Tables.define(f"{mariadb.schema}.pe2", f"{mariadb.schema}.ob2")
    with mariadb.engine.connect() as conn:
        conn.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('half')"))
        with pytest.raises(ConfigurationError, match="inside a transaction"):
            install(conn, tables)
        conn.rollback()
    assert ledger_ids(mariadb, ledger) == []
    assert rows(mariadb, f"SHOW TABLES FROM {mariadb.schema} LIKE 'pe2'") == []


def test_install_again_changes_nothing_and_keys_are_binary(mariadb: Database) -> None:
    install(mariadb.engine, mariadb.tables)  # the fixture installed once already
    created = rows(mariadb, f"SHOW CREATE TABLE {mariadb.name('processed_events')}")[0][1]
    assert "utf8mb4_nopad_bin" in created and "datetime(6)" in created
    assert "ENGINE=InnoDB" in created


def test_install_creates_a_missing_database_as_postgresqls_schema(mariadb: Database) -> None:
    """A MySQL schema is a database: install() makes a missing one (utf8mb4), as it makes a
    PostgreSQL schema, so an App's schema-qualified tables install on either server."""
    other = f"{mariadb.schema}_new"
    tables = Tables.define(f"{other}.processed_events", f"{other}.outbox")
    try:
        install(mariadb.engine, tables)
        charset = rows(
            mariadb,
            "SELECT DEFAULT_CHARACTER_SET_NAME FROM information_schema.SCHEMATA "
            f"WHERE SCHEMA_NAME = '{other}'",
        )
        assert charset == [("utf8mb4",)]
        assert rows(mariadb, f"SHOW TABLES FROM {other} LIKE 'processed_events'") != []
        assert "CREATE DATABASE IF NOT EXISTS" in ddl(mariadb.engine, tables)
        install(mariadb.engine, tables)  # there now: only read
    finally:
        with mariadb.engine.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {other}"))


def test_times_come_back_aware_utc_with_microseconds(mariadb: Database) -> None:
    ledger = mariadb.create_ledger()
    handle = SyncFlavor(mariadb).wrap(insert_ledger(ledger), consumer="c")
    handle(Message(id="a", body=b"x"))
    pe = mariadb.tables.processed_events
    with mariadb.engine.connect() as conn:
        stamp = conn.execute(pe.select()).one().processed_at
    assert stamp.utcoffset() == timedelta(0)
