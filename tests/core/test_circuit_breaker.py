"""The circuit breaker in the pipeline: what counts, what opens it, what an open one does.

A runner gives each batch its breaker (``process_deliveries(breaker=...)``); the
runner tests (tests/memory, tests/rabbitmq, tests/kafka) check that it then
stops taking messages. Here: both drivers, both claim modes, ordered or not.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    Result,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.breaker import CircuitBreaker
from consumerdedup.errors import CircuitOpen
from tests.conftest import Database


def policy(threshold: int | None = 3) -> RetryPolicy:
    zero = timedelta(0)
    return RetryPolicy(attempts=2, initial_delay=zero, max_delay=zero, breaker_threshold=threshold)


class Handled:
    """The ids the handler was called with, and a rule saying which raise what."""

    def __init__(self, rule: Any) -> None:
        self.rule = rule
        self.calls: list[str] = []

    def __call__(self, message: Message) -> None:
        self.calls.append(message.id)
        error = self.rule(message)
        if error is not None:
            raise error


def run(
    db: Database,
    kind: str,
    claim_first: bool,
    messages: list[Message],
    handled: Handled,
    breaker: CircuitBreaker,
    ordered: bool = False,
) -> list[Result]:
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=policy())
        handle = dedup.handler(claim_first=claim_first)(lambda message, session: handled(message))
        return handle.process_deliveries(messages, ordered=ordered, breaker=breaker)

    async def go() -> list[Result]:
        engine = db.async_engine()
        try:
            adedup = AsyncDeduplicator(engine, "c", tables=db.tables, retry=policy())

            @adedup.handler(claim_first=claim_first)
            async def handle(message: Message, session: Any) -> None:
                handled(message)

            return await handle.process_deliveries(messages, ordered=ordered, breaker=breaker)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def recorded(db: Database) -> dict[str, str]:
    pe = db.tables.processed_events.fullname
    with db.engine.connect() as conn:
        return dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())  # type: ignore[arg-type]


def orders(count: int) -> list[Message]:
    return [Message(id=f"m{n:02d}", body=b"{}") for n in range(count)]


flavors = pytest.mark.parametrize(
    ("kind", "claim_first"),
    [("sync", True), ("sync", False), ("async", True), ("async", False)],
    ids=["sync-claim", "sync-check", "async-claim", "async-check"],
)


@flavors
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
def test_a_broken_handler_opens_the_breaker_and_the_rest_is_not_tried(
    sqlite_db: Database, kind: str, claim_first: bool, ordered: bool
) -> None:
    breaker = CircuitBreaker(3, "c")
    handled = Handled(lambda m: KeyError("customer_id"))
    messages = orders(20)
    results = run(sqlite_db, kind, claim_first, messages, handled, breaker, ordered)
    outcomes = [r.outcome for r in results]
    assert outcomes == [Outcome.FAILED] * 3 + [Outcome.RETRY] * 17
    assert all(isinstance(r.error, CircuitOpen) for r in results[3:])
    assert "3 messages in a row failed with KeyError" in str(results[-1].reason)
    # Only the three FAILED are recorded; the rest stay the broker's, untouched.
    assert recorded(sqlite_db) == {f"m{n:02d}": "failed" for n in range(3)}
    assert set(handled.calls) <= {f"m{n:02d}" for n in range(4)}  # at most one more tried
    assert breaker.open and breaker.tripped is not None
    assert breaker.tripped.error_type == "KeyError" and breaker.tripped.failures == 3
    assert breaker.tripped.message_id == "m02"


@flavors
def test_successes_between_failures_keep_it_closed(
    sqlite_db: Database, kind: str, claim_first: bool
) -> None:
    breaker = CircuitBreaker(3, "c")
    # F F P F F P ...: never three in a row.
    handled = Handled(lambda m: KeyError("x") if int(m.id[1:]) % 3 != 2 else None)
    results = run(sqlite_db, kind, claim_first, orders(12), handled, breaker)
    assert [r.outcome for r in results].count(Outcome.FAILED) == 8
    assert Outcome.RETRY not in [r.outcome for r in results]
    assert not breaker.open and breaker.failures == 0  # m11 was PROCESSED last


@flavors
def test_failures_of_different_types_keep_it_closed(
    sqlite_db: Database, kind: str, claim_first: bool
) -> None:
    breaker = CircuitBreaker(3, "c")
    handled = Handled(lambda m: KeyError("x") if int(m.id[1:]) % 2 else ValueError("y"))
    results = run(sqlite_db, kind, claim_first, orders(10), handled, breaker)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 10
    assert not breaker.open


@flavors
def test_a_permanent_error_counts_and_a_transient_one_does_not(
    sqlite_db: Database, kind: str, claim_first: bool
) -> None:
    transient = CircuitBreaker(3, "c")
    handled = Handled(lambda m: RetryLater("the database is away"))
    results = run(sqlite_db, kind, claim_first, orders(6), handled, transient)
    assert {r.outcome for r in results} == {Outcome.RETRY}
    assert not transient.open  # an outage is not the deploy's fault: RETRY, not the breaker

    permanent = CircuitBreaker(3, "c")
    handled = Handled(lambda m: PermanentError("refused"))
    results = run(sqlite_db, kind, claim_first, orders(6), handled, permanent)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 3 + [Outcome.RETRY] * 3
    assert permanent.open


@flavors
def test_an_open_breaker_tries_nothing_and_writes_nothing(
    sqlite_db: Database, kind: str, claim_first: bool
) -> None:
    breaker = CircuitBreaker(1, "c")
    breaker.failed("earlier", KeyError("x"))
    handled = Handled(lambda m: None)
    results = run(sqlite_db, kind, claim_first, orders(5), handled, breaker)
    assert {r.outcome for r in results} == {Outcome.RETRY}
    assert handled.calls == [] and recorded(sqlite_db) == {}
    breaker.reset()
    results = run(sqlite_db, kind, claim_first, orders(5), handled, breaker)
    assert {r.outcome for r in results} == {Outcome.PROCESSED}


def test_the_breaker_counts_across_batches(sqlite_db: Database) -> None:
    breaker = CircuitBreaker(3, "c")
    handled = Handled(lambda m: KeyError("x"))
    outcomes = []
    for message in orders(5):
        outcomes += [r.outcome for r in run(sqlite_db, "sync", True, [message], handled, breaker)]
    assert outcomes == [Outcome.FAILED] * 3 + [Outcome.RETRY] * 2
    assert handled.calls == ["m00", "m00", "m01", "m01", "m02", "m02"]  # 2 attempts each


def test_without_a_breaker_every_message_is_tried_as_before(sqlite_db: Database) -> None:
    """Direct calls (``.batch``, ``.process_batch``) have no breaker: the caller decides."""
    dedup = Deduplicator(sqlite_db.engine, "c", tables=sqlite_db.tables, retry=policy(1))
    handle = dedup.handler(lambda message, session: (_ for _ in ()).throw(KeyError("x")))
    assert handle.batch(orders(4)) == [Outcome.FAILED] * 4


@pytest.mark.parametrize("given", ["10", 0, -1, True, 2.5, [10]])
def test_the_threshold_is_checked_where_it_is_given(given: object) -> None:
    with pytest.raises(ConfigurationError, match=r"RetryPolicy\.breaker_threshold") as raised:
        RetryPolicy(breaker_threshold=given)  # type: ignore[arg-type]
    assert repr(given)[:20] in str(raised.value)


def test_the_default_threshold_is_ten_and_none_turns_it_off() -> None:
    assert RetryPolicy().breaker_threshold == 10
    off = CircuitBreaker(RetryPolicy(breaker_threshold=None).breaker_threshold, "c")
    for n in range(100):
        assert not off.failed(f"m{n}", KeyError("x"))
    assert not off.open


def test_a_broken_bulk_handler_opens_the_breaker_too(sqlite_db: Database) -> None:
    """Bisected down to one message at a time, each FAILED counts as a handler's would."""
    dedup = Deduplicator(sqlite_db.engine, "c", tables=sqlite_db.tables, retry=policy())

    @dedup.bulk_handler
    def handle(messages: list[Message], session: Any) -> None:
        raise KeyError("customer_id")

    breaker = CircuitBreaker(3, "c")
    results = handle.process_deliveries(orders(16), breaker=breaker)
    assert [r.outcome for r in results] == [Outcome.FAILED] * 3 + [Outcome.RETRY] * 13
    assert recorded(sqlite_db) == {f"m{n:02d}": "failed" for n in range(3)}
    assert breaker.open
