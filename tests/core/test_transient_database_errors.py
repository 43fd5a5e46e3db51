"""A deadlock and a serialization failure made for real on PostgreSQL, inside handlers.

The README promises both are transient: retried in process, then PROCESSED once. Two
handlers run at the same time in two threads; a barrier makes them collide on their
first call only, so PostgreSQL has to pick a victim (40P01 deadlock_detected, 40001
serialization_failure); the victim's message must be retried and end PROCESSED with its
effect once, and the error it met must be one the retry policy calls transient.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy.exc
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, Result, RetryPolicy
from consumerdedup.retry import ErrorKind
from tests.conftest import Database

pytestmark = pytest.mark.postgres

POLICY = RetryPolicy(attempts=4, initial_delay=timedelta(0), max_delay=timedelta(0))
WAIT = 30.0


class Collision:
    """Two handlers that meet at a barrier on their first call; the errors they met."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.accounts = db.name("accounts")
        self.ledger = db.create_ledger()
        with db.engine.begin() as conn:
            conn.exec_driver_sql(f"CREATE TABLE {self.accounts} (id TEXT PRIMARY KEY, n INT)")
            conn.exec_driver_sql(f"INSERT INTO {self.accounts} VALUES ('a', 0), ('b', 0)")
        self.barrier = threading.Barrier(2, timeout=WAIT)
        self.calls: dict[str, int] = {}
        self.errors: list[sqlalchemy.exc.DBAPIError] = []
        self.lock = threading.Lock()

    def first_call(self, message: Message) -> bool:
        with self.lock:
            self.calls[message.id] = self.calls.get(message.id, 0) + 1
            return self.calls[message.id] == 1

    def run(self, session: Session, sql: str, **params: Any) -> Any:
        try:
            return session.execute(text(sql), params)
        except sqlalchemy.exc.DBAPIError as exc:
            with self.lock:
                self.errors.append(exc)
            raise

    def effect(self, session: Session, message: Message) -> None:
        self.run(
            session,
            f"INSERT INTO {self.ledger} (account, amount, message_id) VALUES ('x', 1, :m)",
            m=message.id,
        )

    def race(self, engine: Engine, claim_first: bool, fn: Callable[..., None]) -> list[Result]:
        dedup = Deduplicator(engine, "c", tables=self.db.tables, retry=POLICY)
        handle = dedup.handler(claim_first=claim_first)(fn)
        messages = [Message(id="m1", body=b'{"n": 1}'), Message(id="m2", body=b'{"n": 2}')]
        with ThreadPoolExecutor(2) as pool:
            calls = [pool.submit(handle.process, m) for m in messages]
            return [call.result(timeout=120) for call in calls]

    def check(self, results: list[Result], sqlstate: str) -> None:
        assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.PROCESSED], [
            r.reason for r in results
        ]
        # PostgreSQL chose a victim: one error of the expected kind, which the policy retries.
        states = [getattr(e.orig, "sqlstate", None) for e in self.errors]
        assert states == [sqlstate], states
        assert POLICY.classify(self.errors[0]) is ErrorKind.TRANSIENT
        assert sorted(r.attempts for r in results) == [1, 2]
        ledger = self.db.scalar(
            f"SELECT string_agg(message_id, ',' ORDER BY message_id) FROM {self.ledger}"
        )
        assert ledger == "m1,m2"
        records = self.db.scalar(
            f"SELECT count(*) FROM {self.db.name('processed_events')} WHERE outcome = 'processed'"
        )
        assert records == 2


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_real_deadlock_is_retried_in_process_and_processed_once(
    pg: Database, claim_first: bool
) -> None:
    """m1 locks a then b, m2 locks b then a: PostgreSQL breaks the cycle with 40P01."""
    race = Collision(pg)
    order = {"m1": ("a", "b"), "m2": ("b", "a")}

    def handler(message: Message, session: Session) -> None:
        first, second = order[message.id]
        update = f"UPDATE {race.accounts} SET n = n + 1 WHERE id = :id"
        race.run(session, update, id=first)
        if race.first_call(message):
            race.barrier.wait()  # both hold their first row now
        race.run(session, update, id=second)
        race.effect(session, message)

    results = race.race(pg.engine, claim_first, handler)
    race.check(results, "40P01")
    # Each message's two updates committed once: the victim's first try left nothing.
    assert pg.scalar(f"SELECT string_agg(n::text, ',' ORDER BY id) FROM {race.accounts}") == "2,2"


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_a_real_serialization_failure_is_retried_in_process_and_processed_once(
    pg: Database, claim_first: bool
) -> None:
    """SERIALIZABLE: both read the counter, then both write it; the later writer gets 40001."""
    race = Collision(pg)
    serializable = pg.engine.execution_options(isolation_level="SERIALIZABLE")

    def handler(message: Message, session: Session) -> None:
        seen = race.run(session, f"SELECT n FROM {race.accounts} WHERE id = 'a'").scalar_one()
        if race.first_call(message):
            race.barrier.wait()  # both have read the same snapshot
        race.run(session, f"UPDATE {race.accounts} SET n = :n WHERE id = 'a'", n=int(seen) + 1)
        race.effect(session, message)

    results = race.race(serializable, claim_first, handler)
    race.check(results, "40001")
    # No lost update: the retried writer read the first one's committed value.
    assert pg.scalar(f"SELECT n FROM {race.accounts} WHERE id = 'a'") == 2
