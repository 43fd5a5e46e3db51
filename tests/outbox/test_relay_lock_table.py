"""A relay round that runs out of PostgreSQL's shared lock table ("out of shared memory").

A round holds one advisory lock per distinct key it claims until it commits (up to
RelayConfig.batch_size). The shared lock table is sized at server start
(max_locks_per_transaction), so the real error is met on a private server started with a
tiny table (tests/support/private_postgres.py), never on the shared one: filling that one
would fail every other transaction on it. On the shared server, only the classification
is tested, on real SQLSTATE 53200 errors the server raises (RAISE ... USING ERRCODE).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, create_engine, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig
from consumerdedup.doctor import WARN, Settings, diagnose
from consumerdedup.outbox import LockTableFull
from consumerdedup.outbox.lock_space import is_lock_table_full
from consumerdedup.schema import Tables, install
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.support.private_postgres import private_postgres

TINY = {
    "max_connections": 8,
    "superuser_reserved_connections": 0,
    "max_locks_per_transaction": 10,  # 80 documented slots (a few hundred in fact)
    "autovacuum": "off",
    "max_worker_processes": 0,
    "max_wal_senders": 0,
}
EVENTS = 1000  # distinct keys: a round of them all needs 1000 advisory locks
FAST = {"initial_backoff": timedelta(milliseconds=20), "max_backoff": timedelta(milliseconds=50)}


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    with private_postgres(TINY) as url:
        yield url


@pytest.fixture
def tiny(tiny_url: str) -> Iterator[tuple[Engine, Tables]]:
    engine = create_engine(tiny_url, pool_size=2, max_overflow=0)
    tables = Tables.define()
    with engine.begin() as conn:
        conn.execute(text("DROP SCHEMA public CASCADE"))
        conn.execute(text("CREATE SCHEMA public"))
    install(engine, tables)
    with Session(engine) as session:
        for n in range(EVENTS):  # a producer's transaction holds one lock per key too
            Outbox(tables).add(session, "events", str(n).encode(), key=f"k{n}")
            if n % 50 == 49:
                session.commit()
    try:
        yield engine, tables
    finally:
        engine.dispose()


def outbox_state(engine: Engine, tables: Tables) -> tuple[int, int, int]:
    """(unpublished rows, rows charged an attempt, parked rows)."""
    ob = tables.outbox
    with engine.connect() as conn:
        unpublished, charged, parked = conn.execute(
            select(
                func.count().filter(ob.c.published_at.is_(None)),
                func.count().filter(ob.c.attempts > 0),
                func.count().filter(ob.c.parked_at.is_not(None)),
            )
        ).one()
    return unpublished, charged, parked


def test_a_round_too_big_for_the_lock_table_is_a_named_failure_that_commits_nothing(
    tiny: tuple[Engine, Tables],
) -> None:
    engine, tables = tiny
    broker = MemoryBroker()
    relay = OutboxRelay(engine, broker, tables=tables, config=RelayConfig(batch_size=EVENTS))
    with pytest.raises(LockTableFull) as raised:
        relay.run_once()
    said = str(raised.value)
    assert "out of shared memory" in said and "SQLSTATE 53200" in said
    assert "max_locks_per_transaction=10" in said and "max_connections=8" in said
    assert f"RelayConfig.batch_size={EVENTS}" in said and "relay --batch-size" in said
    cause = raised.value.__cause__
    assert isinstance(cause, DBAPIError) and isinstance(cause.orig, psycopg.errors.OutOfMemory)
    assert cause.orig.sqlstate == "53200"  # the server's own error, not one made up here
    assert raised.value.table is not None and raised.value.table.capacity == 80
    assert broker.messages("events") == []
    assert outbox_state(engine, tables) == (EVENTS, 0, 0)  # nothing marked, charged, parked


def test_run_keeps_going_backs_off_and_says_what_to_change(
    tiny: tuple[Engine, Tables], caplog: pytest.LogCaptureFixture
) -> None:
    engine, tables = tiny
    broker = MemoryBroker()
    config = RelayConfig(batch_size=EVENTS, **FAST)  # type: ignore[arg-type]
    relay = OutboxRelay(engine, broker, tables=tables, config=config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            relay.run()
        except BaseException as exc:  # a crash would end the thread: kept to assert on
            errors.append(exc)

    def logged() -> list[logging.LogRecord]:
        return [
            r
            for r in caplog.records
            if r.name == "consumerdedup.relay" and "out of shared memory" in r.getMessage()
        ]

    caplog.set_level(logging.WARNING, "consumerdedup.relay")
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if len(logged()) >= 3 or not thread.is_alive():
                break
            threading.Event().wait(0.05)
        assert thread.is_alive() and not errors, errors
        assert len(logged()) >= 3  # round after round, each backed off, none a crash
        record = logged()[0]
        assert record.levelno == logging.ERROR
        assert "max_locks_per_transaction" in record.getMessage()
        assert "batch_size" in record.getMessage()
    finally:
        relay.stop()
        thread.join(10)
    assert not thread.is_alive() and not errors
    assert broker.messages("events") == [] and outbox_state(engine, tables) == (EVENTS, 0, 0)
    # The fix it names works: a batch the table holds publishes every event.
    small = OutboxRelay(engine, broker, tables=tables, config=RelayConfig(batch_size=20))
    assert small.drain() == EVENTS
    assert len(broker.messages("events")) == EVENTS
    assert outbox_state(engine, tables) == (0, 0, 0)


def test_doctor_warns_where_the_relays_could_fill_the_lock_table(
    tiny: tuple[Engine, Tables],
) -> None:
    engine, tables = tiny
    found = {c.name: c for c in diagnose(engine, tables, Settings(relay_batch_size=EVENTS))}
    check = found["lock table"]
    assert check.status == WARN, check
    assert "max_locks_per_transaction=10" in check.detail and "80 shared lock slots" in check.detail
    assert "batch_size to 24 or less" in check.fix  # (80 / 2) - 16
    assert "max_locks_per_transaction to 254 or more" in check.fix  # 2 x 1016 / 8, rounded up


# Classification, on the shared server: real 53200 errors, raised by the server on purpose ---


def raised_by_server(pg: Database, sql: str) -> DBAPIError:
    with pg.engine.connect() as conn, pytest.raises(DBAPIError) as raised:
        conn.execute(text(sql))
    return raised.value


LOCK_HINT = "You might need to increase max_locks_per_transaction."


@pytest.mark.parametrize(
    ("sql", "lock_table"),
    [
        (
            f"DO $$ BEGIN RAISE EXCEPTION 'out of shared memory' USING ERRCODE = '53200', "
            f"HINT = '{LOCK_HINT}'; END $$",
            True,
        ),
        # As a server with lc_messages in another language says it: the setting's name stays.
        (
            "DO $$ BEGIN RAISE EXCEPTION 'mémoire partagée épuisée' USING ERRCODE = '53200', "
            "HINT = 'Vous pourriez avoir besoin d''augmenter max_locks_per_transaction.'; END $$",
            True,
        ),
        # Out of memory for something else (work_mem): raising lock settings cannot help.
        ("DO $$ BEGIN RAISE EXCEPTION 'out of memory' USING ERRCODE = '53200'; END $$", False),
        ("SELECT 1/0", False),
    ],
    ids=["lock-table", "translated", "other-memory", "other-error"],
)
def test_only_the_lock_tables_out_of_memory_is_named_so(
    pg: Database, sql: str, lock_table: bool
) -> None:
    error = raised_by_server(pg, sql)
    assert is_lock_table_full(error) is lock_table
    assert is_lock_table_full(error.orig) is lock_table  # the driver's own error too
    wrapped: Any = RuntimeError("round failed")
    wrapped.__cause__ = error
    assert is_lock_table_full(wrapped) is lock_table
