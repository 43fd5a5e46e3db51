"""The pipeline's guarantees, on SQLite and PostgreSQL, sync and async."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from consumerdedup import (
    InvalidMessage,
    Message,
    Outcome,
    PayloadMismatch,
    PermanentError,
    RecordedFailure,
    RetryLater,
    RetryPolicy,
)
from tests.conftest import Database, database

FAST = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The claim's guarantees hold on a partitioned processed_events too (locks, not a key)."""
    yield from database(request, request.param, tmp_path)


def payment(mid: Any, account: str = "alice", amount: int = 10) -> Message:
    body = json.dumps({"account": account, "amount": amount}).encode()
    return Message(id=mid, body=body, source="payments")


def credit(ledger: str):  # type: ignore[no-untyped-def]
    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        data = message.json()
        if data.get("fail") == "permanent":
            raise PermanentError("refused by the handler")
        return [
            (
                f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:a, :n, :m)",
                {"a": data["account"], "n": data["amount"], "m": message.id},
            )
        ]

    return behavior


def rows(db: Any, ledger: str) -> list[tuple[Any, ...]]:
    with db.engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.exec_driver_sql(
                f"SELECT account, amount, message_id FROM {ledger} ORDER BY message_id"
            )
        ]


def recorded(db: Any, consumer: str | None = None) -> dict[str, tuple[str, str | None]]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        query = pe.select()
        if consumer:
            query = query.where(pe.c.consumer == consumer)
        return {r.message_id: (r.outcome, r.error) for r in conn.execute(query)}


def test_duplicate_delivery_runs_the_handler_once(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    handle = flavor.wrap(credit(ledger), consumer="ledger")
    assert handle(payment("p-1")) is Outcome.PROCESSED
    assert handle(payment("p-1")) is Outcome.DUPLICATE
    assert handle(payment("p-1")) is Outcome.DUPLICATE
    assert rows(db, ledger) == [("alice", 10, "p-1")]
    assert recorded(db) == {"p-1": ("processed", None)}
    assert handle.dedup.counts[Outcome.DUPLICATE] == 2


def test_key_is_scoped_per_consumer(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    first = flavor.wrap(credit(ledger), consumer="ledger")
    second = flavor.wrap(credit(ledger), consumer="audit")
    assert first(payment("p-1")) is Outcome.PROCESSED
    assert second(payment("p-1")) is Outcome.PROCESSED
    assert second(payment("p-1")) is Outcome.DUPLICATE
    assert len(rows(db, ledger)) == 2


def test_same_id_different_payload_is_reported_not_applied(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    dead: list[Any] = []
    handle = flavor.wrap(credit(ledger), consumer="ledger", dead_letter=dead.append)
    assert handle(payment("p-1", amount=10)) is Outcome.PROCESSED
    result = handle.process(payment("p-1", amount=999))
    assert result.outcome is Outcome.FAILED
    assert isinstance(result.error, PayloadMismatch)
    assert rows(db, ledger) == [("alice", 10, "p-1")]  # the original effect untouched
    assert recorded(db) == {"p-1": ("processed", None)}
    assert len(dead) == 1 and dead[0].message.id == "p-1"
    assert "different payload" in dead[0].reason


@pytest.mark.parametrize(
    ("bad_id", "why"),
    [("", "empty"), ("x" * 256, "256 characters"), (42, "must be a str"), (None, "must be a str")],
)
def test_invalid_key_is_dead_lettered_and_the_batch_goes_on(
    db: Any, flavor: Any, bad_id: Any, why: str
) -> None:
    ledger = db.create_ledger()
    dead: list[Any] = []
    handle = flavor.wrap(credit(ledger), consumer="ledger", dead_letter=dead.append)
    results = handle.process_batch([payment("p-1"), payment(bad_id), payment("p-2")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, InvalidMessage)
    assert why in str(results[1].error)
    assert [r[2] for r in rows(db, ledger)] == ["p-1", "p-2"]
    assert [d.message.id for d in dead] == [bad_id]


def test_max_length_key_is_accepted(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    handle = flavor.wrap(credit(ledger), consumer="ledger")
    assert handle(payment("k" * 255)) is Outcome.PROCESSED
    assert handle(payment("k" * 255)) is Outcome.DUPLICATE


def test_permanent_failures_mid_batch_do_not_sink_the_batch(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    dead: list[Any] = []
    handle = flavor.wrap(credit(ledger), consumer="ledger", dead_letter=dead.append)
    undecodable = Message(id="p-3", body=b"\xff\xfe not json")
    refused = Message(id="p-4", body=json.dumps({"fail": "permanent"}).encode())
    batch = [payment("p-1"), payment("p-2"), undecodable, refused, payment("p-5")]
    outcomes = handle.batch(batch)
    assert outcomes == [
        Outcome.PROCESSED,
        Outcome.PROCESSED,
        Outcome.FAILED,
        Outcome.FAILED,
        Outcome.PROCESSED,
    ]
    assert [r[2] for r in rows(db, ledger)] == ["p-1", "p-2", "p-5"]
    state = recorded(db)
    assert state["p-3"][0] == "failed" and "DecodeError" in (state["p-3"][1] or "")
    assert state["p-4"] == ("failed", "PermanentError: refused by the handler")
    assert {d.message.id for d in dead} == {"p-3", "p-4"}
    # A redelivered failure is not run again but dead-lettered again, with the first reason.
    again = handle.process(refused)
    assert again.outcome is Outcome.FAILED and isinstance(again.error, RecordedFailure)
    assert "refused by the handler" in str(again.error)
    assert len(rows(db, ledger)) == 3


def test_duplicates_within_a_batch_collapse(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    handle = flavor.wrap(credit(ledger), consumer="ledger")
    handle(payment("p-0"))
    batch = [
        payment("p-1"),
        payment("p-0"),
        payment("p-1"),
        payment("p-2"),
        payment("p-1", amount=7),
    ]
    outcomes = handle.batch(batch)
    assert outcomes == [
        Outcome.PROCESSED,
        Outcome.DUPLICATE,
        Outcome.DUPLICATE,
        Outcome.PROCESSED,
        Outcome.FAILED,  # same id, other payload: reported
    ]
    assert [r[2] for r in rows(db, ledger)] == ["p-0", "p-1", "p-2"]


def test_transient_error_that_clears_is_processed_once(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    calls: list[str] = []

    def flaky(message: Message) -> list[tuple[str, dict[str, Any]]]:
        statements = credit(ledger)(message)
        calls.append(message.id)
        if calls.count(message.id) <= 2:
            raise RetryLater("downstream busy")
        return statements

    handle = flavor.wrap(flaky, consumer="ledger", retry=FAST)
    result = handle.process(payment("p-1"))
    assert result.outcome is Outcome.PROCESSED
    assert result.attempts == 3
    assert rows(db, ledger) == [("alice", 10, "p-1")]
    assert recorded(db) == {"p-1": ("processed", None)}


def test_transient_error_that_never_clears_leaves_nothing(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()

    def stuck(message: Message) -> list[tuple[str, dict[str, Any]]]:
        raise RetryLater("downstream down")

    def half_done(message: Message) -> Iterator[tuple[str, dict[str, Any]]]:
        # Writes (the flavor runs each step as it comes), then fails: the write must roll
        # back with the transaction, every time.
        yield from credit(ledger)(message)
        raise RetryLater("downstream down after the write")

    handle = flavor.wrap(stuck, consumer="ledger", retry=FAST)
    result = handle.process(payment("p-1"))
    assert result.outcome is Outcome.RETRY and result.attempts == FAST.attempts
    assert isinstance(result.error, RetryLater)
    partial = flavor.wrap(half_done, consumer="other", retry=FAST)  # type: ignore[arg-type]
    result = partial.process(payment("p-2"))
    assert result.outcome is Outcome.RETRY and result.attempts == FAST.attempts
    assert isinstance(result.error, RetryLater)
    assert rows(db, ledger) == []
    assert recorded(db) == {}  # RETRY records nothing, for either consumer


def test_transient_error_in_a_batch_retries_only_that_message(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    calls: list[str] = []

    def flaky_second(message: Message) -> list[tuple[str, dict[str, Any]]]:
        calls.append(message.id)
        if message.id == "p-2" and calls.count("p-2") == 1:
            raise RetryLater("once")
        return credit(ledger)(message)

    handle = flavor.wrap(flaky_second, consumer="ledger", retry=FAST)
    outcomes = handle.batch([payment("p-1"), payment("p-2"), payment("p-3")])
    assert outcomes == [Outcome.PROCESSED] * 3
    # The optimistic pass (no savepoints) rolls back at p-2; the careful pass redoes the
    # batch with a savepoint per message, and p-2 succeeds on its second try.
    assert calls == ["p-1", "p-2", "p-1", "p-2", "p-3"]
    assert [r[2] for r in rows(db, ledger)] == ["p-1", "p-2", "p-3"]


def test_unknown_error_is_transient_until_attempts_run_out_then_permanent(
    db: Any, flavor: Any
) -> None:
    calls: list[str] = []

    def buggy(message: Message) -> list[tuple[str, dict[str, Any]]]:
        calls.append(message.id)
        raise KeyError("amount")

    handle = flavor.wrap(buggy, consumer="ledger", retry=FAST)
    result = handle.process(payment("p-1"))
    assert result.outcome is Outcome.FAILED and isinstance(result.error, KeyError)
    assert calls == ["p-1"] * FAST.attempts
    assert recorded(db)["p-1"][0] == "failed"
    # Recorded, so a redelivery cannot loop: the handler is not called again.
    assert handle(payment("p-1")) is Outcome.FAILED
    assert len(calls) == FAST.attempts


def test_claim_first_records_the_key_before_the_handler(db: Any, flavor: Any) -> None:
    """The handler's own session sees its claim; no other connection does before COMMIT."""
    ledger = db.create_ledger()
    seen_outside: list[int] = []
    pe = db.tables.processed_events.fullname

    def checks_claim(message: Message) -> list[tuple[str, dict[str, Any]]]:
        with db.engine.connect() as conn:
            # Another connection must not see the claim before commit.
            seen_outside.append(conn.exec_driver_sql(f"SELECT count(*) FROM {pe}").scalar())
        # Inside the handler's transaction: the credit is copied from the claim row, so the
        # ledger gets a row only if the claim is already there (check-first: it is not yet).
        from_claim = (
            f"INSERT INTO {ledger} (account, amount, message_id) SELECT 'alice', 10, message_id "
            f"FROM {pe} WHERE consumer = 'ledger' AND message_id = :m AND outcome = 'processed'"
        )
        return [(from_claim, {"m": message.id})]

    handle = flavor.wrap(checks_claim, claim_first=True, consumer="ledger")
    assert handle(payment("p-1")) is Outcome.PROCESSED
    assert handle(payment("p-1")) is Outcome.DUPLICATE
    assert seen_outside == [0]
    assert rows(db, ledger) == [("alice", 10, "p-1")]


def test_claim_first_failure_leaves_no_claim(db: Any, flavor: Any) -> None:
    ledger = db.create_ledger()
    handle = flavor.wrap(credit(ledger), claim_first=True, consumer="ledger", retry=FAST)
    refused = Message(id="p-9", body=json.dumps({"fail": "permanent"}).encode())
    outcomes = handle.batch([payment("p-1"), refused, payment("p-2")])
    assert outcomes == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    state = recorded(db)
    assert state["p-9"][0] == "failed" and state["p-1"][0] == state["p-2"][0] == "processed"
    assert [r[2] for r in rows(db, ledger)] == ["p-1", "p-2"]


def test_dead_letter_callback_that_raises_leaves_the_message_for_redelivery(
    db: Any, flavor: Any
) -> None:
    ledger = db.create_ledger()

    def broken_dead_letter(result: Any) -> None:
        raise ConnectionError("dead-letter queue unreachable")

    handle = flavor.wrap(credit(ledger), consumer="ledger", dead_letter=broken_dead_letter)
    refused = Message(id="p-9", body=json.dumps({"fail": "permanent"}).encode())
    result = handle.process(refused)
    assert result.outcome is Outcome.RETRY  # not acked: the dead letter must not be lost
    assert "dead-letter queue unreachable" in (result.reason or "")


@pytest.mark.parametrize("failure", ["permanent", "retry"])
def test_a_failure_in_a_pair_still_records_the_other(db: Any, flavor: Any, failure: str) -> None:
    """After the optimistic pass fails, the redo of the one good message is recorded too."""
    ledger = db.create_ledger()
    one_try = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        if message.id == "bad":
            raise PermanentError("no") if failure == "permanent" else RetryLater("later")
        return credit(ledger)(message)

    handle = flavor.wrap(behavior, consumer="ledger", retry=one_try)
    outcomes = handle.batch([payment("good"), payment("bad")])
    assert outcomes[0] is Outcome.PROCESSED
    assert outcomes[1] is (Outcome.FAILED if failure == "permanent" else Outcome.RETRY)
    assert recorded(db)["good"] == ("processed", None)
    assert handle(payment("good")) is Outcome.DUPLICATE
    assert rows(db, ledger) == [("alice", 10, "good")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("claim_first", [True, False])
def test_an_unreachable_database_ends_in_retry_not_a_hang(
    tmp_path: Any, postgres_url: str, claim_first: bool
) -> None:
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from consumerdedup import Deduplicator

    for url in (
        make_url(postgres_url).set(port=1).render_as_string(False),
        f"sqlite:///{tmp_path}/no/such/folder/db.sqlite",
    ):
        dedup = Deduplicator(create_engine(url), consumer="c", retry=FAST)
        handle = dedup.handler(claim_first=claim_first)(lambda message, session: None)
        results = handle.process_batch([payment("p-1"), payment("p-2")])
        assert [r.outcome for r in results] == [Outcome.RETRY, Outcome.RETRY]
        assert all(r.attempts == FAST.attempts for r in results)
