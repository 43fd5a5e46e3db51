"""Attacking the issue-17 pipeline through the public API (round 3, fresh eyes).

- A handler that wraps a setup fault in an error of its own (``raise StorageError(...)
  from exc``, or raised inside its ``except``) had its message FAILED and dead-lettered for
  good: the wrapper hid the 42P01 / "no such table" that the pipeline reads as transient.
- The server's resource and lock faults (53100 disk full, 53200 out of shared memory,
  55P03 lock not available) met by a handler ended FAILED: the environment's fault.
- On an ordered source, a FAILED behind the first RETRY (a RecordedFailure or a
  PayloadMismatch the lookup found, a copy whose payload differs from its leader's) was
  dead-lettered, and again on every re-read of the chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, text

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    Result,
    RetryPolicy,
)
from tests.conftest import Database, postgres_database
from tests.support.private_postgres import private_postgres

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))
MODES = [("sync", True), ("sync", False), ("async", True), ("async", False)]


class StorageError(Exception):
    """A handler's own error type, as a repository layer raises it."""


def _process(
    db: Database,
    kind: str,
    claim_first: bool,
    body: Any,
    messages: list[Message],
    dead: list[Result],
    consumer: str = "c",
    ordered: bool = False,
) -> list[Result]:
    """Run ``body(message, run)`` as a handler of ``kind``; ``run(sql)`` executes SQL."""
    if kind == "sync":
        dedup = Deduplicator(
            db.engine, consumer, tables=db.tables, retry=FAST, dead_letter=dead.append
        )

        @dedup.handler(claim_first=claim_first)
        def handle(message: Message, session: Any) -> None:
            body(message, lambda sql: session.execute(text(sql)))

        return handle.process_batch(messages, ordered=ordered)

    async def main() -> list[Result]:
        engine = db.async_engine()
        try:
            adedup = AsyncDeduplicator(
                engine, consumer, tables=db.tables, retry=FAST, dead_letter=dead.append
            )

            @adedup.handler(claim_first=claim_first)
            async def ahandle(message: Message, session: Any) -> None:
                statements: list[str] = []
                body(message, statements.append)
                for sql in statements:
                    await session.execute(text(sql))

            return await ahandle.process_batch(messages, ordered=ordered)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def _records(db: Database) -> int:
    return int(db.scalar(f"SELECT count(*) FROM {db.name('processed_events')}"))  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["from", "inside-except"])
@pytest.mark.parametrize(("kind", "claim_first"), MODES)
def test_a_wrapped_setup_fault_is_never_a_permanent_failure(
    db: Database, kind: str, claim_first: bool, how: str
) -> None:
    missing = db.name("not_migrated_yet")

    def body(message: Message, run: Any) -> None:
        run(f"SELECT * FROM {missing}")

    def wrapping(message: Message, run: Any) -> None:
        try:
            body(message, run)
        except Exception as exc:
            if how == "from":
                raise StorageError("could not load the order") from exc
            raise StorageError("could not load the order")  # noqa: B904

    dead: list[Result] = []
    if kind == "async":
        results = _process_async_wrapped(db, claim_first, missing, how, dead)
    else:
        results = _process(db, kind, claim_first, wrapping, [Message(id="m", body=b"{}")], dead)
    assert [r.outcome for r in results] == [Outcome.RETRY], results[0].reason
    assert _records(db) == 0 and dead == []


def _process_async_wrapped(
    db: Database, claim_first: bool, missing: str, how: str, dead: list[Result]
) -> list[Result]:
    async def main() -> list[Result]:
        engine = db.async_engine()
        try:
            dedup = AsyncDeduplicator(
                engine, "c", tables=db.tables, retry=FAST, dead_letter=dead.append
            )

            @dedup.handler(claim_first=claim_first)
            async def handle(message: Message, session: Any) -> None:
                try:
                    await session.execute(text(f"SELECT * FROM {missing}"))
                except Exception as exc:
                    if how == "from":
                        raise StorageError("could not load the order") from exc
                    raise StorageError("could not load the order")  # noqa: B904

            return await handle.process_batch([Message(id="m", body=b"{}")])
        finally:
            await engine.dispose()

    return asyncio.run(main())


@pytest.mark.postgres
@pytest.mark.parametrize("sqlstate", ["53100", "53200", "55P03"])
@pytest.mark.parametrize(("kind", "claim_first"), MODES)
def test_resource_and_lock_faults_in_a_handler_are_transient(
    pg: Database, kind: str, claim_first: bool, sqlstate: str
) -> None:
    sql = f"DO $$ BEGIN RAISE EXCEPTION 'the server' USING ERRCODE = '{sqlstate}'; END $$"
    dead: list[Result] = []
    results = _process(
        pg, kind, claim_first, lambda m, run: run(sql), [Message(id="m", body=b"{}")], dead
    )
    assert [r.outcome for r in results] == [Outcome.RETRY], results[0].reason
    assert _records(pg) == 0 and dead == []


@pytest.mark.parametrize(("kind", "claim_first"), MODES)
def test_ordered_failures_behind_a_retry_are_held_back(
    db: Database, kind: str, claim_first: bool
) -> None:
    def refuse(message: Message, run: Any) -> None:
        raise PermanentError("refused")

    first: list[Result] = []
    _process(db, kind, claim_first, refuse, [Message(id="f", body=b"{}")], first)
    assert len(first) == 1  # f is recorded FAILED

    def body(message: Message, run: Any) -> None:
        if message.id == "t":
            raise TimeoutError("the dependency is down")

    chunk = [
        Message(id="t", body=b"{}"),
        Message(id="f", body=b"{}"),  # RecordedFailure from the lookup
        Message(id="g", body=b"1"),
        Message(id="g", body=b"2"),  # same id, another payload
    ]
    for _ in range(2):  # the chunk is read again after the RETRY
        dead: list[Result] = []
        results = _process(db, kind, claim_first, body, chunk, dead, ordered=True)
        assert [r.outcome for r in results] == [Outcome.RETRY] * 4, [r.reason for r in results]
        assert dead == [], [r.reason for r in dead]
    assert _records(db) == 1


TINY_LOCK_TABLE = {
    "max_connections": 8,
    "superuser_reserved_connections": 0,
    "max_locks_per_transaction": 10,
    "autovacuum": "off",
    "max_worker_processes": 0,
    "max_wal_senders": 0,
}


@pytest.fixture(scope="module")
def tiny_lock_table_url() -> Iterator[str]:
    """A private server: filling the shared one's lock table fails every other transaction
    on it (the parallel tests' own, seen as "out of shared memory" in their set-up)."""
    with private_postgres(TINY_LOCK_TABLE) as url:
        yield url


@pytest.fixture
def pg_partitioned(tiny_lock_table_url: str) -> Iterator[Database]:
    yield from postgres_database(tiny_lock_table_url, partitioned=True)


@pytest.mark.postgres
@pytest.mark.parametrize(("kind", "claim_first"), [("sync", True), ("async", False)])
def test_a_partitioned_claim_past_the_lock_table_halves_and_completes(
    pg_partitioned: Database, kind: str, claim_first: bool
) -> None:
    """One advisory lock per key, held to the end of the transaction: a batch larger than
    the server's lock table (max_locks_per_transaction x connections) fails our lock
    statement with 53200. Halved until it fits, never retried as is (every message RETRY
    on every redelivery). On a private server with a tiny lock table."""
    with pg_partitioned.engine.connect() as conn:
        slots = conn.exec_driver_sql(
            "SELECT current_setting('max_locks_per_transaction')::int * "
            "(current_setting('max_connections')::int + "
            "current_setting('max_prepared_transactions')::int)"
        ).scalar_one()
    messages = [Message(id=f"k{n}", body=b"{}") for n in range(2 * slots + 1000)]
    refused: list[str] = []
    if kind == "sync":  # the async engine is _process's own

        @event.listens_for(pg_partitioned.engine, "handle_error")
        def seen(context: Any) -> None:
            refused.append(getattr(context.original_exception, "sqlstate", None) or "")

    dead: list[Result] = []
    results = _process(pg_partitioned, kind, claim_first, lambda m, run: None, messages, dead)
    if kind == "sync":
        assert "53200" in refused, "the batch fitted the lock table: the test proves nothing"
    outcomes = {r.outcome for r in results}
    assert outcomes == {Outcome.PROCESSED}, {r.reason for r in results}
    assert _records(pg_partitioned) == len(messages) and dead == []


@pytest.mark.parametrize(("kind", "claim_first"), MODES)
def test_another_transient_failure_is_no_outage_to_give_up_on(
    db: Database, kind: str, claim_first: bool
) -> None:
    """Unordered [new-type (its table not migrated), slow (its service times out), c]:
    once new-type used up its attempts, slow's timeout is another failure, not the same
    outage; c ended RETRY untried on every redelivery, for good, behind two messages that
    were not its own."""
    missing = db.name("not_migrated_yet")

    def body(message: Message, run: Any) -> None:
        if message.id == "new-type":
            run(f"SELECT * FROM {missing}")
        if message.id == "slow":
            raise TimeoutError("the pricing service")

    chunk = [Message(id=key, body=b"{}") for key in ("new-type", "slow", "c")]
    dead: list[Result] = []
    results = _process(db, kind, claim_first, body, chunk, dead)
    assert [r.outcome for r in results] == [Outcome.RETRY, Outcome.RETRY, Outcome.PROCESSED], [
        r.reason for r in results
    ]
    assert _records(db) == 1 and dead == []
