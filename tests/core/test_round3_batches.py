"""Issue 17 items 9 and 13b: batches of any size, and overlapping batches that cannot deadlock.

A batch's keys travel as bound parameters; past the driver's limit (psycopg 65,535,
SQLite's SQLITE_MAX_VARIABLE_NUMBER) a statement of ours would fail on every attempt.
The claim's rows go in key order, so two batches sharing keys wait, never deadlock.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event

from consumerdedup import Message, Outcome, Result
from tests.conftest import Database
from tests.support.flavors import AsyncFlavor, SyncFlavor

BIG = 70_000
"""Past psycopg's 65,535 bound parameters in one statement."""


def messages(prefix: str, count: int) -> list[Message]:
    return [Message(id=f"{prefix}{n}", body=b"{}") for n in range(count)]


def processed_before(db: Database, prefix: str, count: int) -> None:
    """``count`` keys recorded as processed by an earlier delivery, written directly: the
    redelivery is what binds a parameter per key, and it calls no handler."""
    from consumerdedup.message import payload_hash
    from consumerdedup.schema import utcnow

    pe = db.tables.processed_events
    row = {"consumer": "c", "payload_hash": payload_hash(b"{}"), "outcome": "processed"}
    now = utcnow()
    with db.engine.begin() as conn:
        conn.execute(
            pe.insert(),
            [{**row, "message_id": f"{prefix}{n}", "processed_at": now} for n in range(count)],
        )


def stored(db: Database) -> int:
    count = db.scalar(f"SELECT count(*) FROM {db.name('processed_events')}")
    assert isinstance(count, int)
    return count


@pytest.fixture(params=["sync-claim", "sync-check", "async-check"])
def flavor_on(request: pytest.FixtureRequest, pg: Database) -> Iterator[Any]:
    """PostgreSQL without partitions: a partitioned table's statements bind arrays. The
    asyncio driver sends the same statements (a 70,000-key claim costs psycopg ~10 s to
    parse here, so async-claim adds time, not coverage)."""
    kind, mode = request.param.split("-")
    chosen = (SyncFlavor if kind == "sync" else AsyncFlavor)(pg, claim_first=mode == "claim")
    yield chosen
    chosen.close()


def test_a_redelivered_batch_past_the_drivers_parameter_limit_is_answered_duplicate(
    pg: Database, flavor_on: Any
) -> None:
    """The issue's case: 70,000 processed messages delivered again (with 10 new ones)."""
    processed_before(pg, "k", BIG)
    errors = failed_statements(pg)
    handle = flavor_on.wrap(lambda message: [], consumer="c")
    again = handle.process_batch([*messages("k", BIG), *messages("new", 10)])
    assert [r.outcome for r in again] == [Outcome.DUPLICATE] * BIG + [Outcome.PROCESSED] * 10, (
        _sample(again)
    )
    assert stored(pg) == BIG + 10
    if flavor_on.name == "sync":  # cut to fit: no statement of ours was refused
        assert errors == [], errors[:3]


@pytest.mark.slow
def test_a_new_batch_past_the_drivers_parameter_limit_is_processed_check_first(
    pg: Database,
) -> None:
    """Check-first looks all 70,000 keys up before the handlers run (claim-first's lookup
    runs only for keys already taken: the redelivery test)."""
    handle = SyncFlavor(pg, claim_first=False).wrap(lambda message: [], consumer="c")
    first = handle.process_batch(messages("k", BIG))
    assert {r.outcome for r in first} == {Outcome.PROCESSED}, _sample(first)
    assert stored(pg) == BIG


def test_a_statement_the_driver_refuses_without_a_code_splits_the_batch(
    pg: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the chunking taken out, psycopg refuses the 70,000-key lookup itself ("number of
    parameters must be between 0 and 65535", no SQLSTATE): the span is halved instead of
    being retried as is on every attempt and every redelivery."""
    from consumerdedup.dedup import statements

    monkeypatch.setattr(statements, "MAX_PARAMETERS", 10**9)
    processed_before(pg, "k", BIG)
    handle = SyncFlavor(pg, claim_first=False).wrap(lambda message: [], consumer="c")
    again = handle.process_batch(messages("k", BIG))
    assert {r.outcome for r in again} == {Outcome.DUPLICATE}, _sample(again)


def failed_statements(db: Database) -> list[str]:
    """Every statement error on ``db``'s engine from now on (ours halve, quietly)."""
    seen: list[str] = []

    @event.listens_for(db.engine, "handle_error")
    def _seen(context: Any) -> None:
        seen.append(str(context.original_exception)[:120])

    return seen


def _limited(db: Database, limit: int) -> None:
    """Every new connection of ``db``'s engine gets SQLite's default (or an old) limit."""

    @event.listens_for(db.engine, "connect")
    def _limit(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, limit)

    db.engine.dispose()


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
@pytest.mark.parametrize(("limit", "count"), [(32_766, 33_000), (999, 2_000)], ids=["3.32", "old"])
def test_sqlite_batches_past_its_variable_limit_are_processed(
    sqlite_db: Database, claim_first: bool, limit: int, count: int
) -> None:
    """SQLITE_MAX_VARIABLE_NUMBER as most builds have it (32,766) is cut to fit; a build with
    a lower one (999) fails with a code, and the span is halved until it fits."""
    _limited(sqlite_db, limit)
    processed_before(sqlite_db, "k", count)
    errors = failed_statements(sqlite_db)
    handle = SyncFlavor(sqlite_db, claim_first=claim_first).wrap(lambda m: [], consumer="c")
    again = handle.process_batch([*messages("k", count), *messages("new", 3_000)])
    assert [r.outcome for r in again] == [Outcome.DUPLICATE] * count + [
        Outcome.PROCESSED
    ] * 3_000, _sample(again)
    assert stored(sqlite_db) == count + 3_000
    if limit == 32_766:  # cut to fit (MAX_PARAMETERS): no statement of ours was refused
        assert errors == [], errors[:3]


def _sample(results: list[Result]) -> list[tuple[str, str | None]]:
    odd = [r for r in results if r.outcome not in (Outcome.PROCESSED, Outcome.DUPLICATE)]
    return [(r.outcome.name, r.reason) for r in odd[:3]]


# Item 13 (b): the unpartitioned claim goes in key order, so overlapping batches never deadlock.


def _waiting_on_locks(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(
            conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND state = 'active' AND query LIKE %(table)s",
                {"table": f"%{db.schema}.processed_events%"},
            ).scalar_one()
        )


@pytest.mark.parametrize("claim_first", [True, False], ids=["claim", "check"])
def test_two_batches_sharing_keys_in_opposite_orders_do_not_deadlock(
    pg: Database, claim_first: bool
) -> None:
    """[a, z, b] and [b, z, a] at once, while another transaction holds z: each batch takes
    its first key, both wait on z, then z is released. In batch order each would wait on the
    other's first key (40P01 after deadlock_timeout, then retried); in key order the second
    waits behind the first instead."""
    from consumerdedup.message import payload_hash
    from consumerdedup.schema import utcnow

    deadlocks: list[str] = []

    @event.listens_for(pg.engine, "handle_error")
    def _deadlock(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == "40P01":
            deadlocks.append(str(context.original_exception)[:100])

    pe = pg.tables.processed_events
    done: dict[str, list[Result]] = {}
    handles = [
        SyncFlavor(pg, claim_first=claim_first).wrap(lambda m: [], consumer="c") for _ in "12"
    ]
    batches = {"one": ["a", "z", "b"], "two": ["b", "z", "a"]}
    with pg.engine.connect() as holder:
        holder.execute(
            pe.insert(),
            {
                "consumer": "c",
                "message_id": "z",
                "payload_hash": payload_hash(b"{}"),
                "outcome": "processed",
                "processed_at": utcnow(),
            },
        )  # uncommitted: holds z until the commit below
        threads = [
            threading.Thread(
                target=lambda name=name, handle=handle: done.setdefault(
                    name, handle.process_batch(messages_named(batches[name]))
                )
            )
            for name, handle in zip(batches, handles, strict=True)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 20
        while _waiting_on_locks(pg) < 2:
            assert time.monotonic() < deadline, "the two batches never both waited on a lock"
            time.sleep(0.01)
        holder.commit()
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert deadlocks == [], deadlocks
    outcomes = {name: {r.message.id: r.outcome for r in done[name]} for name in batches}
    assert outcomes["one"]["z"] is outcomes["two"]["z"] is Outcome.DUPLICATE
    for key in ("a", "b"):
        assert {outcomes["one"][key], outcomes["two"][key]} == {
            Outcome.PROCESSED,
            Outcome.DUPLICATE,
        }
    assert stored(pg) == 3


def messages_named(ids: list[str]) -> list[Message]:
    return [Message(id=i, body=b"{}") for i in ids]
