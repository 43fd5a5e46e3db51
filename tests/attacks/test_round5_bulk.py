"""Round 5: bulk handlers (issue 21) attacked through the public API on SQLite and the real
PostgreSQL. All held when written; kept so that they keep holding.

- ``BatchMessageFailed`` naming no message of the call (an index past the end, a negative
  one, a bool, a Message or an id not in the call): bisected, only the real culprit fails;
- a bulk handler that swallows a database error on PostgreSQL: that message alone fails;
- twins with different payloads in one batch: the first processed, the other
  ``PayloadMismatch``, the third (same payload) DUPLICATE, the handler never sees a twin;
- ids no database can store (NUL, a lone surrogate, empty, 10 KB, 256 characters) in the
  multi-row claim: FAILED at once, never handed to the handler, the rest processed.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from consumerdedup import (
    BatchMessageFailed,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryPolicy,
)
from tests.conftest import Database

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
P, F, D = Outcome.PROCESSED, Outcome.FAILED, Outcome.DUPLICATE


def _ledger(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(text(f"SELECT mid FROM {db.name('ledger')}")))


@pytest.fixture
def ledger(db: Database) -> Database:
    with db.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {db.name('ledger')} (mid TEXT PRIMARY KEY)"))
        conn.execute(text(f"INSERT INTO {db.name('ledger')} VALUES ('taken')"))
    return db


@pytest.mark.parametrize(
    "named", [5, -1, True, Message(id="stranger", body=b""), "stranger"], ids=repr
)
def test_a_culprit_named_outside_the_call_is_found_by_bisection(
    ledger: Database, named: object
) -> None:
    dedup = Deduplicator(ledger.engine, "round5", tables=ledger.tables, retry=FAST)
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")

    @dedup.bulk_handler
    def place(messages: list[Message], session: Any) -> None:
        for message in messages:
            if message.id == "m2":
                raise BatchMessageFailed(named, PermanentError("bad m2"))
            session.execute(insert, {"m": message.id})

    results = place.process_batch([Message(id=f"m{i}", body=b"{}") for i in range(5)])
    assert [r.outcome for r in results] == [P, P, F, P, P]
    assert _ledger(ledger) == ["m0", "m1", "m3", "m4", "taken"]


def test_a_swallowed_database_error_fails_its_message_alone(ledger: Database) -> None:
    dedup = Deduplicator(ledger.engine, "round5", tables=ledger.tables, retry=FAST)
    insert = text(f"INSERT INTO {ledger.name('ledger')} VALUES (:m)")

    @dedup.bulk_handler
    def place(messages: list[Message], session: Any) -> None:
        for message in messages:
            with contextlib.suppress(IntegrityError):  # PostgreSQL: the transaction aborts
                session.execute(insert, {"m": "taken" if message.id == "m2" else message.id})

    results = place.process_batch([Message(id=f"m{i}", body=b"{}") for i in range(5)])
    swallowed = F if ledger.dialect == "postgresql" else P  # SQLite: the statement alone failed
    assert [r.outcome for r in results] == [P, P, swallowed, P, P]
    assert _ledger(ledger) == ["m0", "m1", "m3", "m4", "taken"]


def test_twins_in_one_bulk_batch_never_reach_the_handler(ledger: Database) -> None:
    dedup = Deduplicator(ledger.engine, "round5", tables=ledger.tables, retry=FAST)
    seen: list[list[str]] = []
    place = dedup.bulk_handler(lambda messages, session: seen.append([m.id for m in messages]))
    batch = [
        Message(id="m1", body=b"one"),
        Message(id="m2", body=b"{}"),
        Message(id="m1", body=b"two"),
        Message(id="m1", body=b"one"),
    ]
    assert [r.outcome for r in place.process_batch(batch)] == [P, P, F, D]
    assert seen == [["m1", "m2"]]


def test_ids_no_database_can_store_fail_at_once_in_the_multi_row_claim(db: Database) -> None:
    dedup = Deduplicator(db.engine, "round5", tables=db.tables, retry=FAST)
    seen: list[list[str]] = []
    place = dedup.bulk_handler(lambda messages, session: seen.append([m.id for m in messages]))
    ids = ["ok1", "a\x00b", "x" * 10240, "ok2", "\ud800", "", "y" * 255, "z" * 256]
    results = place.process_batch([Message(id=i, body=b"{}") for i in ids])
    assert [r.outcome for r in results] == [P, F, F, P, F, F, P, F]
    assert seen == [["ok1", "ok2", "y" * 255]]
