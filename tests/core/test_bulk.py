"""Bulk handlers (issue 20 item 1): one call per transaction with the new messages only,
a failure charged to its culprit alone (named by the handler, else found by bisection).

Every test runs on SQLite and PostgreSQL, with the blocking and the asyncio driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    BatchMessageFailed,
    CommitInHandler,
    HeldBack,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
)
from tests.conftest import Database
from tests.support.bulk_ledger import BulkLedger, messages, poisoned


@pytest.fixture(params=["sync", "async"])
def ledger(request: pytest.FixtureRequest, db: Database) -> Iterator[BulkLedger]:
    chosen = BulkLedger(db, request.param)
    yield chosen
    chosen.close()


def outcomes(results: list[Any]) -> list[Outcome]:
    return [result.outcome for result in results]


def test_one_call_gets_exactly_the_new_messages(ledger: BulkLedger) -> None:
    process = ledger.handler()
    process([Message(id="m-00", body=b"{}")])  # recorded by an earlier delivery
    batch = [Message(id=i, body=b"{}") for i in ("m-00", "m-01", "m-02", "m-01", "m-03")]
    results = process(batch)
    assert outcomes(results) == [
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,  # a twin within the batch
        Outcome.PROCESSED,
    ]
    assert ledger.calls == [["m-00"], ["m-01", "m-02", "m-03"]]  # in delivery order
    assert ledger.applied() == ["m-00", "m-01", "m-02", "m-03"]
    assert ledger.recorded() == dict.fromkeys(["m-00", "m-01", "m-02", "m-03"], "processed")


def test_bisection_isolates_a_permanent_culprit(ledger: BulkLedger) -> None:
    batch = messages(16)
    results = ledger.handler(poisoned({"m-05"}, PermanentError))(batch)
    assert [r.message.id for r in results if r.outcome is Outcome.FAILED] == ["m-05"]
    good = [m.id for m in batch if m.id != "m-05"]
    assert ledger.applied() == good
    assert ledger.recorded() == {**dict.fromkeys(good, "processed"), "m-05": "failed"}
    assert 2 < len(ledger.calls) <= 2 * 4 + 2  # about 2·log2(16) calls, not 16


def test_an_unknown_error_uses_its_attempts_then_fails(ledger: BulkLedger) -> None:
    results = ledger.handler(poisoned({"m-02"}, RuntimeError))(messages(6))
    culprit = results[2]
    assert culprit.outcome is Outcome.FAILED and culprit.attempts == 2  # QUICK: 2 attempts
    assert sum(1 for call in ledger.calls if call == ["m-02"]) == 2
    assert outcomes(results).count(Outcome.PROCESSED) == 5
    assert ledger.recorded()["m-02"] == "failed"


def test_a_transient_culprit_ends_retry_with_nothing_recorded(ledger: BulkLedger) -> None:
    results = ledger.handler(poisoned({"m-03"}, RetryLater))(messages(8))
    assert results[3].outcome is Outcome.RETRY and results[3].attempts == 2
    assert "m-03" not in ledger.recorded() and "m-03" not in ledger.applied()
    assert outcomes(results).count(Outcome.PROCESSED) == 7


def test_ordered_nothing_behind_the_first_undecided_commits(ledger: BulkLedger) -> None:
    results = ledger.handler(poisoned({"m-03"}, RetryLater))(messages(8), ordered=True)
    assert outcomes(results) == [Outcome.PROCESSED] * 3 + [Outcome.RETRY] * 5
    assert all(isinstance(r.error, HeldBack) for r in results[4:])
    assert ledger.applied() == ["m-00", "m-01", "m-02"]
    assert sorted(ledger.recorded()) == ["m-00", "m-01", "m-02"]


@pytest.mark.parametrize("naming", ["index", "message", "id"])
def test_a_culprit_the_handler_names_skips_the_bisection(ledger: BulkLedger, naming: str) -> None:
    def fail(batch: list[Message], session: Any) -> None:
        for index, message in enumerate(batch):
            if message.id == "m-05":
                named = {"index": index, "message": message, "id": message.id}[naming]
                raise BatchMessageFailed(named, PermanentError("bad amount"))

    batch = messages(12)
    results = ledger.handler(fail)(batch)
    assert results[5].outcome is Outcome.FAILED and "bad amount" in str(results[5].reason)
    ids = [m.id for m in batch]
    # The whole batch, then the batch without its culprit (whose FAILED record is written
    # in the same transaction): no halving.
    assert ledger.calls == [ids, ids[:5] + ids[6:]]
    assert ledger.applied() == ids[:5] + ids[6:]
    assert ledger.recorded()["m-05"] == "failed"


def test_a_name_outside_the_batch_is_bisected_instead(ledger: BulkLedger) -> None:
    def fail(batch: list[Message], session: Any) -> None:
        if any(m.id == "m-01" for m in batch):
            raise BatchMessageFailed(99, PermanentError("wrong index"))

    results = ledger.handler(fail)(messages(4))
    assert outcomes(results) == [Outcome.PROCESSED, Outcome.FAILED] + [Outcome.PROCESSED] * 2


def test_a_swallowed_database_error_is_isolated(ledger: BulkLedger) -> None:
    """The handler catches the poison's failing statement and goes on: on PostgreSQL the
    transaction is aborted, and only the poison's message may pay for it."""
    bad = text(
        "SELECT CAST('x' AS integer)" if ledger.db.dialect == "postgresql" else "SELECT json('{')"
    )

    def fail(batch: list[Message], session: Any) -> None:
        if any(m.id == "m-02" for m in batch):
            with contextlib.suppress(Exception):
                session.execute(bad)

    async def fail_async(batch: list[Message], session: Any) -> None:
        if any(m.id == "m-02" for m in batch):
            with contextlib.suppress(Exception):
                await session.execute(bad)

    results = ledger.handler(fail_async if ledger.kind == "async" else fail)(messages(6))
    good = [r.message.id for r in results if r.outcome is Outcome.PROCESSED]
    assert set(good) >= {"m-00", "m-01", "m-03", "m-04", "m-05"}
    assert ledger.applied() == sorted(good)
    if ledger.db.dialect == "postgresql":
        assert results[2].outcome is Outcome.FAILED  # TransactionBroken, classified by cause
        assert ledger.recorded()["m-02"] == "failed"


def test_the_guard_refuses_a_commit_in_a_bulk_handler(ledger: BulkLedger) -> None:
    def fail(batch: list[Message], session: Any) -> None:
        if any(m.id == "m-01" for m in batch):
            (session.sync_session if ledger.kind == "async" else session).commit()

    results = ledger.handler(fail)(messages(4))
    assert results[1].outcome is Outcome.FAILED
    assert isinstance(results[1].error, CommitInHandler)
    assert ledger.applied() == ["m-00", "m-02", "m-03"]


def test_hostile_ids_fail_alone_and_never_reach_the_handler(ledger: BulkLedger) -> None:
    hostile = ["nul\x00id", "x" * 300, "", "\udcff"]
    odd = ["'; DROP TABLE ledger; --", "é" * 255, "m 1"]
    batch = [Message(id=i, body=b"{}") for i in [*hostile, *odd]]
    results = ledger.handler()(batch)
    assert outcomes(results) == [Outcome.FAILED] * 4 + [Outcome.PROCESSED] * 3
    assert ledger.calls == [odd]
    assert ledger.applied() == sorted(odd)


def test_the_result_is_a_handler_like_any_other(ledger: BulkLedger) -> None:
    from consumerdedup import AsyncDeduplicator, Deduplicator

    db = ledger.db
    if ledger.kind == "sync":
        dedup = Deduplicator(db.engine, consumer="one", tables=db.tables)

        @dedup.bulk_handler()
        def handle(batch: list[Message], session: Any) -> None:
            ledger.calls.append([m.id for m in batch])

        assert handle(Message(id="a", body=b"1")) is Outcome.PROCESSED
        assert handle.batch(messages(2)) == [Outcome.PROCESSED] * 2
        assert handle(Message(id="a", body=b"1")) is Outcome.DUPLICATE
    else:
        import asyncio

        adedup = AsyncDeduplicator(db.async_engine(), consumer="one", tables=db.tables)

        @adedup.bulk_handler
        async def handle_async(batch: list[Message], session: Any) -> None:
            ledger.calls.append([m.id for m in batch])

        async def run() -> None:
            assert await handle_async(Message(id="a", body=b"1")) is Outcome.PROCESSED
            assert await handle_async.batch(messages(2)) == [Outcome.PROCESSED] * 2
            await adedup.engine.dispose()

        asyncio.run(run())
    assert ledger.calls == [["a"], ["m-00", "m-01"]]


def test_a_partitioned_table_claims_and_bisects_alike(pg_partitioned: Database) -> None:
    """processed_events by day: the claim is a lock then an INSERT of the unheld keys."""
    ledger = BulkLedger(pg_partitioned, "sync")
    process = ledger.handler(poisoned({"m-03"}, PermanentError))
    process([Message(id="m-00", body=b"{}")])
    results = process([*messages(6), Message(id="m-01", body=b"{}")])
    assert outcomes(results) == [
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
    ]
    assert ledger.applied() == ["m-00", "m-01", "m-02", "m-04", "m-05"]
    assert ledger.recorded()["m-03"] == "failed"
    ledger.close()


def test_a_bulk_handler_of_the_wrong_kind_is_refused(sqlite_db: Database) -> None:
    from consumerdedup import AsyncDeduplicator, ConfigurationError, Deduplicator

    dedup = Deduplicator(sqlite_db.engine, consumer="kinds", tables=sqlite_db.tables)
    adedup = AsyncDeduplicator(sqlite_db.async_engine(), consumer="kinds", tables=sqlite_db.tables)

    async def coroutine(messages: list[Message], session: Any) -> None: ...

    def plain(messages: list[Message], session: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="AsyncDeduplicator"):
        dedup.bulk_handler(coroutine)
    with pytest.raises(ConfigurationError, match="async def"):
        adedup.bulk_handler(plain)
