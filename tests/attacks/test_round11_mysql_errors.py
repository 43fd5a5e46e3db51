"""Round 11 attacks on MySQL/MariaDB: errors a handler swallows, in batches and bulk calls,
and keys the server would compare loosely.

A deadlock (1213) rolls back the WHOLE transaction: in a batch that is every batch-mate's
claim and writes too. A lock wait timeout (1205) undoes its statement alone (the
default, innodb_rollback_on_timeout=OFF) but is treated as ending the call. Whatever
happens, every message of the batch ends with its effects exactly once (PROCESSED) or
none (FAILED/RETRY), and batch-mates of the culprit commit (invariant 4).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

from consumerdedup import (
    AsyncDeduplicator,
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    RetryPolicy,
)
from consumerdedup.db import mysql_errors
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database
from tests.core.test_mysql import Deadlocker, ledger_ids, rows

FAST_RETRY = RetryPolicy(attempts=8, initial_delay=timedelta(milliseconds=5))


def msgs(*ids: str) -> list[Message]:
    return [Message(id=i, body=b"x") for i in ids]


@pytest.mark.parametrize("kind", ["handler", "bulk"])
def test_a_deadlock_swallowed_mid_batch_leaves_each_message_applied_once(
    mariadb: Database, kind: str
) -> None:
    """m1 writes, m2 swallows a real deadlock (which undid m1's claim and write too) and
    writes again, m3 writes. Every message PROCESSED, each write exactly once, none of the
    deadlocked attempt's: no batch-mate's effect lost with the rollback, none doubled."""
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    def one(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})
        if message.id == "m2" and not seen:
            session.execute(text(deadlocker.first_half()))
            deadlocker.start_other()
            try:
                session.execute(text(deadlocker.second_half()))
            except OperationalError as exc:
                seen.append(str(mysql_errors.errno(exc)))
                with pytest.raises(DBAPIError):
                    session.execute(insert, {"m": "after"})

    if kind == "handler":
        handle: Any = dedup.handler(one)
    else:

        @dedup.bulk_handler
        def handle(messages: list[Message], session: Any) -> None:
            for message in messages:
                one(message, session)

    results = handle.batch(msgs("m1", "m2", "m3"))
    deadlocker.join()
    assert seen == [str(mysql_errors.DEADLOCK)]
    assert results == [Outcome.PROCESSED] * 3
    assert ledger_ids(mariadb, ledger) == ["m1", "m2", "m3"]
    assert handle.batch(msgs("m1", "m2", "m3")) == [Outcome.DUPLICATE] * 3
    assert ledger_ids(mariadb, ledger) == ["m1", "m2", "m3"]


def test_a_swallowed_lock_wait_timeout_ends_the_call(mariadb: Database) -> None:
    """1205 with innodb_rollback_on_timeout OFF (the server's default) undoes the waiting
    statement alone, yet the call is over: the handler's next statement is refused and the
    attempt retried; the message ends with the second attempt's writes only."""
    ledger = mariadb.create_ledger()
    locks = mariadb.name("locks")
    with mariadb.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {locks} (id INT PRIMARY KEY, n INT)"))
        conn.execute(text(f"INSERT INTO {locks} VALUES (1, 0)"))
    assert rows(mariadb, "SELECT @@innodb_rollback_on_timeout") == [(0,)]
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    holder = create_engine(mariadb.url, poolclass=None).connect()
    holder.execute(text(f"UPDATE {locks} SET n = 1 WHERE id = 1"))  # held, uncommitted
    attempts: list[str] = []
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        attempts.append("attempt")
        session.execute(insert, {"m": f"{message.id}-{len(attempts)}"})
        if len(attempts) == 1:
            session.execute(text("SET SESSION innodb_lock_wait_timeout = 1"))
            try:
                session.execute(text(f"UPDATE {locks} SET n = 2 WHERE id = 1"))
            except OperationalError as exc:
                attempts.append(str(mysql_errors.errno(exc)))
            holder.rollback()  # the row is free for the retry
            with pytest.raises(DBAPIError):
                session.execute(insert, {"m": "after"})
            return
        session.execute(text(f"UPDATE {locks} SET n = 2 WHERE id = 1"))

    try:
        assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    finally:
        holder.close()
        engine.dispose()
    assert attempts[:2] == ["attempt", str(mysql_errors.LOCK_WAIT_TIMEOUT)]
    assert ledger_ids(mariadb, ledger) == [f"m-{len(attempts)}"]
    assert rows(mariadb, f"SELECT n FROM {locks}") == [(2,)]


def test_a_deadlock_between_two_batches_loses_and_doubles_nothing(mariadb: Database) -> None:
    """Two batches of the same ids in opposite orders, in two threads started together (a
    barrier): the multi-row claim inserts in key order whatever the batch's order, so
    the batches do not deadlock each other, and every id is applied once."""
    ledger = mariadb.create_ledger()
    engine = create_engine(mariadb.url, pool_size=4)
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)
    calls: list[str] = []
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        calls.append(message.id)
        session.execute(insert, {"m": message.id})

    ids = [f"k{i:02d}" for i in range(20)]
    barrier = threading.Barrier(2)
    outcomes: list[Outcome] = []

    def run(order: list[str]) -> None:
        barrier.wait(10)
        outcomes.extend(handle.batch(msgs(*order)))

    threads = [
        threading.Thread(target=run, args=(ids,)),
        threading.Thread(target=run, args=(ids[::-1],)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    engine.dispose()
    assert Counter(outcomes) == Counter({Outcome.PROCESSED: 20, Outcome.DUPLICATE: 20})
    assert ledger_ids(mariadb, ledger) == ids


@pytest.mark.parametrize(
    "ids",
    [["a", "a\x00"], ["a", "a\t"], ["ß", "ss"], ["\u00c5", "A\u030a"], ["i", "\u0131"]],
    ids=["nul", "tab", "sharp-s", "composed", "dotless"],
)
def test_ids_the_server_could_fold_together_are_distinct(mariadb: Database, ids: list[str]) -> None:
    """NUL and tab endings, and pairs a Unicode collation equates (ß/ss, composed and
    decomposed A-ring, i and dotless i): each its own message, or refused as InvalidMessage, never
    DUPLICATE of the other with its effects lost."""
    ledger = mariadb.create_ledger()
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": message.id})

    first = handle.batch(msgs(*ids))
    assert Outcome.DUPLICATE not in first
    applied = [i for i, o in zip(ids, first, strict=True) if o is Outcome.PROCESSED]
    assert sorted(r[0] for r in rows(mariadb, f"SELECT message_id FROM {ledger}")) == sorted(
        applied
    )
    assert handle.batch(msgs(*applied)) == [Outcome.DUPLICATE] * len(applied)


@pytest.mark.parametrize("kind", ["handler", "bulk"])
def test_a_batch_claim_storm_whose_first_inserter_rolls_back(mariadb: Database, kind: str) -> None:
    """A transaction holds the claim of 'b' uncommitted; four batches of a, b, c (two in
    reverse order) wait on it in their multi-row claims; it rolls back. Gap locks may
    deadlock the waiters (1213, retried); each id is applied exactly once in the end:
    one PROCESSED and three DUPLICATE for each."""
    ledger = mariadb.create_ledger()
    pe = mariadb.name("processed_events")
    twins = 4
    engine = create_engine(mariadb.url, pool_size=twins + 2)
    dedup = Deduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    if kind == "handler":

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            session.execute(insert, {"m": message.id})

    else:

        @dedup.bulk_handler
        def handle(messages: list[Message], session: Any) -> None:
            session.execute(insert, [{"m": m.id} for m in messages])

    holder = engine.connect()
    holder.execute(
        text(
            f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, outcome) "
            "VALUES ('c', 'b', NOW(6), 'h', 'processed')"
        )
    )
    results: list[list[Outcome]] = []
    errors: list[BaseException] = []

    def run(order: str) -> None:
        try:
            results.append(list(zip(order, handle.batch(msgs(*order)), strict=True)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [
        threading.Thread(target=run, args=("abc" if i % 2 == 0 else "cba",), daemon=True)
        for i in range(twins)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    waiting = text(
        "SELECT count(*) FROM information_schema.processlist "
        "WHERE command = 'Query' AND info LIKE :q"
    )
    with engine.connect() as watch:
        while watch.execute(waiting, {"q": f"INSERT INTO {pe}%"}).scalar() < twins:
            assert time.monotonic() < deadline, "the batches never all waited on the claims"
            watch.rollback()
    holder.rollback()
    holder.close()
    for thread in threads:
        thread.join(60)
    engine.dispose()
    assert not errors, errors
    per_id = Counter((i, o) for batch in results for i, o in batch)
    for key in "abc":
        assert per_id[(key, Outcome.PROCESSED)] == 1, per_id
        assert per_id[(key, Outcome.DUPLICATE)] == twins - 1, per_id
    assert ledger_ids(mariadb, ledger) == ["a", "b", "c"]


@pytest.mark.parametrize("where", ["plain", "savepoint"])
def test_a_swallowed_deadlock_after_an_outbox_add_publishes_once(
    mariadb: Database, where: str
) -> None:
    """The handler adds an outbox event (its key's bucket row locked), then meets a real
    deadlock, in its transaction or inside ``begin_nested()`` (whose ROLLBACK TO then finds
    no savepoint: InnoDB rolled back everything), swallows it and goes on. The retry is
    the only attempt that commits: one event, one ledger row."""
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []
    dedup = Deduplicator(mariadb.engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)
    outbox = Outbox(mariadb.tables)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(insert, {"m": f"{message.id}-{len(seen) + 1}"})
        outbox.add(session, "q", f"{message.id}-{len(seen) + 1}".encode(), key="K")
        if seen:
            seen.append("clean")
            return
        session.execute(text(deadlocker.first_half()))
        deadlocker.start_other()
        try:
            if where == "savepoint":
                with session.begin_nested():
                    session.execute(text(deadlocker.second_half()))
            else:
                session.execute(text(deadlocker.second_half()))
        except Exception as exc:  # anything: the deadlock, or the guard's refusal after it
            seen.append(str(mysql_errors.errno(exc) or type(exc).__name__))
        with contextlib.suppress(Exception):
            outbox.add(session, "q", b"after", key="K")

    assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    deadlocker.join()
    assert seen[0] in (str(mysql_errors.DEADLOCK), "TransactionBroken"), seen
    assert seen[-1] == "clean"
    assert ledger_ids(mariadb, ledger) == [f"m-{len(seen)}"]
    broker = MemoryBroker()
    OutboxRelay(mariadb.engine, broker, tables=mariadb.tables).drain()
    assert [m.body.decode() for m in broker.messages("q")] == [f"m-{len(seen)}"]


def test_an_async_batch_with_a_swallowed_deadlock_applies_each_message_once(
    mariadb: Database,
) -> None:
    """The batch attack on aiomysql: m2 swallows a real deadlock (which undid m1's claim
    and write too) and writes again; every message PROCESSED, each write exactly once."""
    ledger = mariadb.create_ledger()
    deadlocker = Deadlocker(mariadb)
    seen: list[str] = []
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    async def main() -> tuple[list[Outcome], list[Outcome]]:
        engine = mariadb.async_engine()
        dedup = AsyncDeduplicator(engine, consumer="c", tables=mariadb.tables, retry=FAST_RETRY)

        @dedup.handler
        async def handle(message: Message, session: Any) -> None:
            await session.execute(insert, {"m": message.id})
            if message.id == "m2" and not seen:
                await session.execute(text(deadlocker.first_half()))
                await asyncio.to_thread(deadlocker.start_other)
                try:
                    await session.execute(text(deadlocker.second_half()))
                except OperationalError as exc:
                    seen.append(str(mysql_errors.errno(exc)))
                    with contextlib.suppress(DBAPIError):
                        await session.execute(insert, {"m": "after"})

        try:
            first = await handle.batch(msgs("m1", "m2", "m3"))
            again = await handle.batch(msgs("m1", "m2", "m3"))
            return first, again
        finally:
            await engine.dispose()

    first, again = asyncio.run(main())
    deadlocker.join()
    assert seen == [str(mysql_errors.DEADLOCK)]
    assert first == [Outcome.PROCESSED] * 3
    assert again == [Outcome.DUPLICATE] * 3
    assert ledger_ids(mariadb, ledger) == ["m1", "m2", "m3"]
