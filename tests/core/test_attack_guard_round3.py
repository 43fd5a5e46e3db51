"""Attacks on the fail-closed guard of issue 17 (items 1 to 5), through the public API.

Each test is a way found to get past the guard as it stood after that round:
a spelling of transaction control the server reads one way and our lexer
another, and what a handler can do around the statements the guard sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import AsyncDeduplicator, ConfigurationError, Deduplicator, Message, Outcome
from consumerdedup.db.control_sql import transaction_control
from consumerdedup.errors import TransactionBroken
from tests.conftest import Database
from tests.core.test_guard_fails_closed import KIND_IDS, KINDS, ends_alone
from tests.core.test_pipeline_attacks import (
    FAST,
    assert_invariants,
    create_ledger,
    effects,
    order,
    records,
)

EMOJI = "\U0001f600"
LEXER_MISSES = [
    # A name ending in a character past the BMP: its $ is part of the name, no dollar quote.
    f"SELECT 1 AS a{EMOJI}$x$; COMMIT; SELECT 1 AS b{EMOJI}$x$",
    # A dollar tag with such a character: $a😀$ quotes, so the $a$ inside it is text.
    f"SELECT $a{EMOJI}$ $a$ $a{EMOJI}$; COMMIT; SELECT $a{EMOJI}$ $a$ $a{EMOJI}$",
    # A -- comment ends at a carriage return too.
    "SELECT 1; -- note\rCOMMIT",
]


@pytest.mark.parametrize("sql", [*LEXER_MISSES, "PREPARE TRANSACTION'gid'"])
def test_postgresql_reads_these_as_transaction_control(sql: str) -> None:
    assert transaction_control(sql, "postgresql") is not None


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
@pytest.mark.parametrize("spelling", LEXER_MISSES)
def test_spellings_the_lexer_read_differently_fail_their_message_alone(
    db: Database, flavor: Any, spelling: str
) -> None:
    """Before: claim-first [t1, t2, t3] ended all DUPLICATE with t3's effect never made;
    check-first kept t2's effect four times though t2 was recorded FAILED."""
    ends_alone(db, flavor, spelling)


# A transaction ended through the raw DB-API connection, then another statement ------------


def run_batch(kind: str, db: Database, claim_first: bool, fn: Any, sync_fn: Any) -> Any:
    """Process [t1, t2, t3]; t2's handler also runs ``sync_fn`` / awaits ``fn`` on its session."""
    ledger = create_ledger(db)
    batch = [order("t1"), order("t2", end=True), order("t3")]
    sql = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)

        def handle(message: Message, session: Session) -> None:
            session.execute(sql, {"m": message.id})
            if message.json().get("end"):
                sync_fn(session)
                session.execute(sql, {"m": message.id + "-after"})

        handler = dedup.handler(claim_first=claim_first)(handle)
        return ledger, batch, handler.process_batch(batch), handler.process_batch(batch)
    engine = db.async_engine()

    async def go() -> Any:
        try:
            dedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=FAST)

            async def handle(message: Message, session: AsyncSession) -> None:
                await session.execute(sql, {"m": message.id})
                if message.json().get("end"):
                    await fn(session)
                    await session.execute(sql, {"m": message.id + "-after"})

            handler = dedup.handler(claim_first=claim_first)(handle)
            return await handler.process_batch(batch), await handler.process_batch(batch)
        finally:
            await engine.dispose()

    return (ledger, batch, *asyncio.run(go()))


def raw_rollback(session: Session) -> None:
    session.connection().connection.driver_connection.rollback()  # type: ignore[union-attr]


async def raw_rollback_async(session: AsyncSession) -> None:
    connection = await session.connection()
    raw = await connection.get_raw_connection()
    await raw.driver_connection.rollback()  # type: ignore[union-attr]


@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_a_raw_rollback_followed_by_a_statement_fails_its_message_alone(
    db: Database, kind: str, claim_first: bool
) -> None:
    """Before: the driver began a new transaction at the next statement, which passed for
    ours: claim-first reported all three PROCESSED with no record at all (t1 lost, t3 applied
    again on every redelivery)."""
    ledger, _, results, again = run_batch(kind, db, claim_first, raw_rollback_async, raw_rollback)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, TransactionBroken), results[1].reason
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.FAILED, Outcome.DUPLICATE]


# A handler whose call returns its work wrapped ----------------------------------------------


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_contextmanager_handler_records_nothing(db: Database, claim_first: bool) -> None:
    """``@contextmanager`` on a handler: its call returns a context manager around the un-run
    generator. Before: PROCESSED with no effect, every redelivery DUPLICATE."""
    ledger = create_ledger(db)
    dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)

    @dedup.handler(claim_first=claim_first)
    @contextlib.contextmanager
    def handle(message: Message, session: Session) -> Iterator[None]:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        yield

    with pytest.raises(ConfigurationError, match="contextmanager"):
        handle.process_batch([order("t1"), order("t2")])
    assert effects(db, ledger) == []
    assert records(db) == {}


def test_an_async_handler_returning_a_context_manager_records_nothing(db: Database) -> None:
    ledger = create_ledger(db)
    engine = db.async_engine()

    @contextlib.contextmanager
    def work(session: Any) -> Iterator[None]:
        yield

    async def go() -> None:
        try:
            dedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=FAST)

            @dedup.handler
            async def handle(message: Message, session: AsyncSession) -> Any:
                return work(session)

            with pytest.raises(ConfigurationError, match="context manager"):
                await handle.process(order("t1"))
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert effects(db, ledger) == []
    assert records(db) == {}


# A DB-API connection whose transaction state cannot be read ---------------------------------


class Traced:
    """A tracing wrapper (``creator=``) that forwards the DB-API methods and nothing else."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self.connection = connection

    def cursor(self) -> sqlite3.Cursor:
        return self.connection.cursor()

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()

    def close(self) -> None:
        self.connection.close()

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        self.connection.create_function(*args, **kwargs)


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_connection_that_does_not_report_its_transaction_is_refused(
    sqlite_db: Database, claim_first: bool
) -> None:
    """Before: the AttributeError of the missing attribute was retried, then each message
    ended FAILED and dead-lettered: a setup fault charged to the messages."""
    path = sqlite_db.url.removeprefix("sqlite:///")
    engine = create_engine("sqlite://", creator=lambda: Traced(sqlite3.connect(path)))
    ledger = create_ledger(sqlite_db)
    try:
        dedup = Deduplicator(engine, "c", tables=sqlite_db.tables, retry=FAST)

        @dedup.handler(claim_first=claim_first)
        def handle(message: Message, session: Session) -> None:
            session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('x')"))

        with pytest.raises(ConfigurationError, match="does not report the open transaction"):
            handle.process_batch([order("t1"), order("t2")])
    finally:
        engine.dispose()
    assert effects(sqlite_db, ledger) == []
    assert records(sqlite_db) == {}


class TracedPsycopg:
    """The same wrapper over psycopg: SQLAlchemy's dialect itself breaks on it when connecting."""

    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self.connection.cursor(*args, **kwargs)

    def commit(self) -> None:
        self.connection.commit()

    def rollback(self) -> None:
        self.connection.rollback()

    def close(self) -> None:
        self.connection.close()


def test_an_engine_that_breaks_while_connecting_stops_the_run(pg: Database) -> None:
    """Before: the dialect's AttributeError was retried, then both messages ended FAILED and
    were dead-lettered. A connection refused by the server is still retried (OperationalError)."""
    import psycopg

    url = pg.engine.url
    engine = create_engine(
        url, creator=lambda: TracedPsycopg(psycopg.connect(host=url.host, dbname=url.database))
    )
    try:
        dedup = Deduplicator(engine, "c", tables=pg.tables, retry=FAST)
        handle = dedup.handler(lambda message, session: None)
        with pytest.raises(ConfigurationError, match="could not begin a transaction"):
            handle.process_batch([order("t1"), order("t2")])
    finally:
        engine.dispose()
    assert records(pg) == {}


# A handler that makes its own transaction refuse our record ---------------------------------


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
@pytest.mark.parametrize("flavor", ["sync-check", "async-check"], indirect=True)
def test_a_handler_that_makes_the_transaction_read_only_fails_alone(
    db: Database, flavor: Any
) -> None:
    """Check-first records after the handlers; t2's handler made the transaction read only,
    so that INSERT met 25006, read as a setup fault: process_batch raised ConfigurationError on
    every delivery of t2 (the runner stopped for good, 0 of 3 decided). Now t2 fails alone:
    its FAILED record is written with no handler in the transaction, where a real read-only
    database still stops the run (tests/core/test_setup_errors.py)."""
    ledger = create_ledger(db)
    read_only = "SELECT set_config('transaction_read_only', 'on', true)"

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(f"INSERT INTO {ledger} (message_id) VALUES (:m)", {"m": message.id})]
        return steps + ([(read_only, {})] if message.json().get("end") else [])

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    batch = [order("t1"), order("t2", end=True), order("t3")]
    results = handle.process_batch(batch)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert "read-only" in (results[1].reason or ""), results[1].reason
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_session_factory_without_autobegin_stops_the_run(db: Database, kind: str) -> None:
    """Before: SQLAlchemy's 'Autobegin is disabled on this Session' was retried, then every
    message ended FAILED and was dead-lettered, a setup fault charged to the messages."""
    messages = [order("t1"), order("t2")]
    if kind == "sync":
        dedup = Deduplicator(
            db.engine,
            "c",
            tables=db.tables,
            retry=FAST,
            session_factory=sessionmaker(db.engine, autobegin=False),
        )
        with pytest.raises(ConfigurationError, match="Autobegin is disabled"):
            dedup.handler(lambda message, session: None).process_batch(messages)
    else:
        engine = db.async_engine()

        async def nothing(message: Message, session: AsyncSession) -> None:
            pass

        async def go() -> None:
            try:
                factory = async_sessionmaker(engine, autobegin=False)
                dedup = AsyncDeduplicator(
                    engine, "c", tables=db.tables, retry=FAST, session_factory=factory
                )
                with pytest.raises(ConfigurationError, match="Autobegin is disabled"):
                    await dedup.handler(nothing).process_batch(messages)
            finally:
                await engine.dispose()

        asyncio.run(go())
    assert records(db) == {}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_two_phase_session_factory_stops_the_run(db: Database, kind: str) -> None:
    """Before, on PostgreSQL without prepared transactions: PREPARE TRANSACTION at our commit
    failed, and every message ended FAILED and dead-lettered (a setup fault charged to them)."""
    messages = [order("t1"), order("t2")]
    if kind == "sync":
        factory: Any = sessionmaker(db.engine, twophase=True)
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST, session_factory=factory)
        with pytest.raises(ConfigurationError, match="twophase"):
            dedup.handler(lambda message, session: None).process_batch(messages)
    else:
        engine = db.async_engine()

        async def nothing(message: Message, session: AsyncSession) -> None:
            pass

        async def go() -> None:
            try:
                factory = async_sessionmaker(engine, twophase=True)
                dedup = AsyncDeduplicator(
                    engine, "c", tables=db.tables, retry=FAST, session_factory=factory
                )
                with pytest.raises(ConfigurationError, match="twophase"):
                    await dedup.handler(nothing).process_batch(messages)
            finally:
                await engine.dispose()

        asyncio.run(go())
    assert records(db) == {}
