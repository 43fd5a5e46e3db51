"""Round 8: the server's bound on a transaction (25P03, 25P04) charged as the message's own.

Since 4dd28b6, retry.py classifies idle_in_transaction_session_timeout (25P03) and
transaction_timeout (25P04) as UNKNOWN (tried again, then FAILED) even on an invalidated
connection. Attacked through the public API on the real PostgreSQL 15 (no
transaction_timeout there: the bound is idle_in_transaction_session_timeout, set as a
connect option, the way a role or database default would set it).

Broke, and fixed (now regression tests):
- 25P03 surfaces at the next statement, so it is charged to the handler that sent it, not to
  the one that idled: a handler idle outside the database makes the next batch-mate's first
  statement fail, and with ``attempts=1`` that innocent message ends FAILED (and the one after
  it, when the idler runs again). Claim-first and check-first, ordered or not.
- The pipelined BEGIN (BEGIN + claim in one psycopg pipeline) leaves PostgreSQL 15's idle
  timer unarmed: a handler stuck before its first statement is never ended by the bound,
  and a twin waits on its claim as long as it hangs.

Fixed at the root: an outlasted transaction met at a handler's call is the transaction's
failure, not that handler's (dedup/failures.py: the span halves to the message that idled,
which is then charged alone); and a connection whose server bounds idle transactions is
begun the plain way, not pipelined (db/pipelined_begin.py ``_idle_bound``), so the bound
holds from the claim on.

Held: with a second try, the blamed batch-mate runs alone and commits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine

from consumerdedup import Deduplicator, Message, Outcome, Result, RetryPolicy
from tests.attacks.test_round6 import effects, recorded
from tests.attacks.test_round7_driver_guard import FAST, insert_sql, ledger, msgs, outcomes
from tests.conftest import Database

__all__ = ["ledger"]  # the fixture, reused

BOUND = "-c idle_in_transaction_session_timeout=100"
"""The server's bound on an idle transaction, 100 ms, as a role or database default would set it."""
OUTLAST = 0.3
ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
"""No retry in process: the broker's redelivery is the retry (attempts >= 1 is allowed)."""


@pytest.fixture
def bounded(ledger: Database) -> Iterator[Engine]:
    """A pool of one connection under the 100 ms bound."""
    engine = create_engine(ledger.url, pool_size=1, max_overflow=0, connect_args={"options": BOUND})
    yield engine
    engine.dispose()


def slow_then_batch(
    db: Database, engine: Engine, policy: RetryPolicy, claim_first: bool, ordered: bool = False
) -> list[Result]:
    """m0, slow, m2, m3: ``slow`` calls something outside the database that outlasts the
    bound (no statement of its own); the others write their row at once and return."""
    dedup = Deduplicator(engine, "round8", tables=db.tables, retry=policy)
    insert = insert_sql(db)

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Any) -> None:
        if message.id == "slow":
            time.sleep(OUTLAST)
            return
        session.execute(insert, {"m": message.id})

    return handle.process_batch(msgs("m0", "slow", "m2", "m3"), ordered=ordered)


INNOCENT = ["m0", "m2", "m3"]


def assert_innocents_done(db: Database, results: list[Result]) -> None:
    """Invariant 1 for the batch-mates (``slow`` has no effects of its own to check)."""
    done, records = effects(db), recorded(db)
    for result in results:
        if result.message.id != "slow" and result.outcome is Outcome.PROCESSED:
            assert result.message.id in done, f"{result.message.id} PROCESSED w/o effects"
    for key in INNOCENT:
        if records.get(key) == Outcome.PROCESSED.value:
            assert key in done, f"{key} recorded PROCESSED without its effects"


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_the_message_after_an_idle_handler_is_not_blamed(
    ledger: Database, bounded: Engine, claim_first: bool, ordered: bool
) -> None:
    results = slow_then_batch(ledger, bounded, ONCE, claim_first, ordered)
    by_id = {r.message.id: r for r in results}
    assert_innocents_done(ledger, results)
    for mid in INNOCENT:
        assert by_id[mid].outcome is Outcome.PROCESSED, (mid, by_id[mid].reason)
    assert effects(ledger) == INNOCENT
    # The one that idled ends FAILED alone (one try), with the server's reason.
    assert by_id["slow"].outcome is Outcome.FAILED, by_id["slow"].reason
    assert "idle-in-transaction timeout" in (by_id["slow"].reason or "")


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_with_a_retry_the_message_after_an_idle_handler_commits(
    ledger: Database, bounded: Engine, claim_first: bool
) -> None:
    """Fixed at the root: an outlasted transaction met at a handler's call is the transaction's
    failure, not that handler's (dedup/failures.py: the span halves to the message that idled,
    which is then charged alone); and a connection whose server bounds idle transactions is
    begun the plain way, not pipelined (db/pipelined_begin.py ``_idle_bound``), so the bound
    holds from the claim on.

    Held: with a second try, the blamed batch-mate runs alone and commits."""
    results = slow_then_batch(ledger, bounded, FAST, claim_first, ordered=True)
    by_id = {r.message.id: r for r in results}
    assert_innocents_done(ledger, results)
    assert [by_id[m].outcome for m in INNOCENT] == [Outcome.PROCESSED] * 3
    assert effects(ledger) == INNOCENT
    assert recorded(ledger).get("m2") == Outcome.PROCESSED.value


def test_the_bound_ends_a_handler_stuck_before_its_first_statement(
    ledger: Database, bounded: Engine
) -> None:
    stuck_in = threading.Event()
    insert = insert_sql(ledger)

    def deduplicator(engine: Engine, stuck: bool) -> Any:
        dedup = Deduplicator(engine, "round8", tables=ledger.tables, retry=FAST)

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            if stuck:
                stuck_in.set()
                time.sleep(1.2)  # stuck: what the bound is documented to end
            session.execute(insert, {"m": message.id})

        return handle

    twin_engine = create_engine(ledger.url, connect_args={"options": BOUND})
    try:
        stuck = deduplicator(bounded, stuck=True)
        twin = deduplicator(twin_engine, stuck=False)
        stuck_results: list[Result] = []
        runner = threading.Thread(target=lambda: stuck_results.extend(stuck.batch(msgs("k"))))
        runner.start()
        assert stuck_in.wait(5)
        started = time.monotonic()
        twin_results = twin.process_batch(msgs("k"))
        waited = time.monotonic() - started
        runner.join(5)
    finally:
        twin_engine.dispose()
    assert effects(ledger) == ["k"], "applied once"
    assert waited < 0.8, f"the twin waited {waited:.2f} s on a claim the bound should end"
    assert outcomes(twin_results) == [Outcome.PROCESSED]
