"""Advisory locks belong to their table: equal keys in unrelated tables never block each other.

PostgreSQL has one advisory-lock space per database. Each test holds a lock
on one table (a transaction left open, or a relay, consumer or pruner stopped
mid-round) and shows that the same key on another table goes through at once,
and, where it matters, that the same table reached under another name is
still excluded. Waits are bounded (lock_timeout, or a thread with a deadline)
so a regression fails in seconds instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, insert, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from consumerdedup import (
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    Pruner,
    Publisher,
    Tables,
)
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database, database
from tests.prune.test_pruner import NOW, clock

pytestmark = pytest.mark.postgres

DEADLINE = 5.0
"""Seconds the other table's work may take; it takes milliseconds when nothing blocks it."""


@pytest.fixture
def pg_b(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A second schema with its own processed_events and outbox, same table names."""
    yield from database(request, "postgresql", tmp_path)


@pytest.fixture
def partitioned_b(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, "postgresql-partitioned", tmp_path)


def on_path(db: Database) -> Engine:
    """An engine whose search_path is ``db``'s schema, for unqualified table names."""
    return create_engine(db.url, connect_args={"options": f"-csearch_path={db.schema}"})


def in_thread(work: Callable[[], Any]) -> tuple[threading.Thread, threading.Event, list[Any]]:
    done, results = threading.Event(), []

    def run() -> None:
        try:
            results.append(work())
        except BaseException as exc:  # reported by the test, not lost in the thread
            results.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done, results


class Gate:
    """Stops whoever calls ``pass_through`` until ``open``; ``reached`` tells it got there."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def pass_through(self) -> None:
        self.reached.set()
        assert self.opened.wait(60), "the gate was never opened"

    def open(self) -> None:
        self.opened.set()


# --- Outbox.add ------------------------------------------------------------------------------


def add_with_timeout(engine: Engine, tables: Tables, key: str) -> str:
    with Session(engine) as session, session.begin():
        session.execute(text("SET LOCAL lock_timeout = '1s'"))
        return Outbox(tables).add(session, "orders", b"{}", key=key)


def test_a_key_held_in_one_outbox_does_not_block_the_same_key_in_another(
    pg: Database, pg_b: Database
) -> None:
    with Session(pg.engine) as holder:
        Outbox(pg.tables).add(holder, "orders", b"{}", key="acct01")  # open: A's lock is held
        try:
            add_with_timeout(pg_b.engine, pg_b.tables, "acct01")  # outbox B: not blocked
            # The same outbox under another name (unqualified, through search_path) still waits.
            same_table = on_path(pg)
            try:
                with pytest.raises(OperationalError, match="lock timeout"):
                    add_with_timeout(same_table, Tables.define(), "acct01")
            finally:
                same_table.dispose()
        finally:
            holder.rollback()


# --- the relay -------------------------------------------------------------------------------


class GatedPublisher(Publisher):
    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.broker = MemoryBroker()

    def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None) -> None:
        self.gate.pass_through()
        self.broker.publish(destination, body, key, headers)


def test_a_relay_mid_round_on_a_key_does_not_hold_back_that_key_in_another_outbox(
    pg: Database, pg_b: Database
) -> None:
    for db in (pg, pg_b):
        with Session(db.engine) as session, session.begin():
            Outbox(db.tables).add(session, "orders", b"{}", key="acct01")
    gate = Gate()
    relay_a = OutboxRelay(pg.engine, GatedPublisher(gate), tables=pg.tables)
    thread, _, results = in_thread(relay_a.run_once)
    try:
        assert gate.reached.wait(DEADLINE)  # relay A holds its lock on acct01 now
        relay_b = OutboxRelay(pg_b.engine, MemoryBroker(), tables=pg_b.tables)
        assert relay_b.run_once() == 1
        # A second relay on outbox A itself must still leave the key alone.
        assert OutboxRelay(pg.engine, MemoryBroker(), tables=pg.tables).run_once() == 0
    finally:
        gate.open()
        thread.join(30)
    assert results == [1]


# --- the partitioned claim -------------------------------------------------------------------


def test_a_partitioned_claim_does_not_wait_for_the_same_key_in_another_table(
    pg_partitioned: Database, partitioned_b: Database
) -> None:
    gate = Gate()
    first = Deduplicator(pg_partitioned.engine, "payments", tables=pg_partitioned.tables)
    held = first.handler(lambda message, session: gate.pass_through())
    second = Deduplicator(partitioned_b.engine, "payments", tables=partitioned_b.tables)
    quick = second.handler(lambda message, session: None)
    message = Message(id="acct01", body=b"{}")
    thread_a, _, results_a = in_thread(lambda: held(message))
    try:
        assert gate.reached.wait(DEADLINE)  # table A's claim lock on (payments, acct01) is held
        thread_b, done_b, results_b = in_thread(lambda: quick(message))
        finished = done_b.wait(DEADLINE)
    finally:
        gate.open()
        thread_a.join(30)
    thread_b.join(30)
    assert finished, "the claim on table B waited for table A's transaction"
    assert results_a == [Outcome.PROCESSED] and results_b == [Outcome.PROCESSED]


# --- the pruner ------------------------------------------------------------------------------


def stop_after_lock(engine: Engine, gate: Gate) -> None:
    """Stop the engine's first statement after the pruner took its lock, until the gate opens."""
    locked = threading.Event()

    @event.listens_for(engine, "before_cursor_execute")
    def hold(*args: Any) -> None:
        statement = args[2]
        if "pg_try_advisory_lock" in statement:
            locked.set()
        elif locked.is_set() and not gate.reached.is_set():
            gate.pass_through()


def test_a_pruner_mid_round_does_not_skip_the_pruner_of_another_schema_with_the_same_names(
    pg: Database, pg_b: Database
) -> None:
    """Unqualified names through two search_paths: two tables, two locks."""
    for db in (pg, pg_b):
        with db.engine.begin() as conn:
            old = NOW - timedelta(days=30)
            row = {"consumer": "c", "message_id": "m", "processed_at": old}
            conn.execute(
                insert(db.tables.processed_events),
                [{**row, "payload_hash": "0" * 64, "outcome": "processed"}],
            )
    engine_a, engine_b = on_path(pg), on_path(pg_b)
    gate = Gate()
    stop_after_lock(engine_a, gate)
    week = timedelta(days=7)
    pruner_a = Pruner(engine_a, week, tables=Tables.define(), clock=clock)
    thread, _, results = in_thread(pruner_a.run_once)
    try:
        assert gate.reached.wait(DEADLINE)  # pruner A holds its lock
        report = Pruner(engine_b, week, tables=Tables.define(), clock=clock).run_once()
        assert not report.skipped and report.total == 1
        # Another pruner of table A, named in full this time, is still turned away.
        assert Pruner(pg.engine, week, tables=pg.tables, clock=clock).run_once().skipped
    finally:
        gate.open()
        thread.join(30)
        engine_a.dispose()
        engine_b.dispose()
    assert [r.total for r in results] == [1]
