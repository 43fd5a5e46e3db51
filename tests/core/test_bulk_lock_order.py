"""Lock order (issue 20 item 6): two batch consumers over the same keys in opposite orders
must not deadlock on the library's own locks (the claim, the outbox's per-key locks).

Each consumer's batch of 20 adds one outbox event per message, keyed k-00..k-19 on one
side and k-19..k-00 on the other. Before the fix each ``Outbox.add`` locked its key as
the handler ran, in delivery order: the two first handlers hold k-00 and k-19, then each
waits for the other's (PostgreSQL: deadlock detected, SQLSTATE 40P01, after
deadlock_timeout). Now a batch's keyed events are held back and their keys locked in
one order just before COMMIT, so one batch waits for the other instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import event, text

from consumerdedup import Deduplicator, Message, Outbox, Outcome, PermanentError
from tests.conftest import Database

KEYS = [f"k-{i:02d}" for i in range(20)]


@pytest.fixture
def deadlocks(pg: Database) -> Iterator[list[str]]:
    """Every deadlock error a statement of the test's engine met (SQLSTATE 40P01)."""
    seen: list[str] = []

    def count(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == "40P01":
            seen.append(str(context.original_exception))

    event.listen(pg.engine, "handle_error", count)
    yield seen
    event.remove(pg.engine, "handle_error", count)


def both_hold_a_key_first(barrier: threading.Barrier) -> Callable[[], None]:
    """Wait, once per consumer, until both have run their first handler: with the old code
    each then holds its first key's lock, the start of a certain deadlock."""
    waited = threading.local()

    def wait() -> None:
        if not getattr(waited, "done", False):
            waited.done = True
            barrier.wait(timeout=10)

    return wait


def run_two(process: Callable[[list[Message]], list[Outcome]]) -> list[list[Outcome]]:
    """Both consumers' batches at once, in opposite key orders."""
    results: list[list[Outcome]] = [[], []]

    def consume(side: int) -> None:
        order = KEYS if side == 0 else KEYS[::-1]
        batch = [Message(id=f"s{side}-{key}", body=key.encode()) for key in order]
        results[side] = process(batch)

    threads = [threading.Thread(target=consume, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


@pytest.mark.parametrize("kind", ["per-message", "bulk"])
def test_two_batches_over_the_same_keys_do_not_deadlock(
    pg: Database, deadlocks: list[str], kind: str
) -> None:
    outbox = Outbox(pg.tables)
    dedup = Deduplicator(pg.engine, consumer="locks", tables=pg.tables)
    first = both_hold_a_key_first(threading.Barrier(2))

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, message.id[:2], message.body, key=message.body.decode())
        first()

    @dedup.bulk_handler
    def handle_bulk(messages: list[Message], session: Any) -> None:
        for message in messages:  # in delivery order, as documented
            outbox.add(session, message.id[:2], message.body, key=message.body.decode())
            first()

    process = handle.batch if kind == "per-message" else handle_bulk.batch
    results = run_two(process)
    assert results == [[Outcome.PROCESSED] * 20, [Outcome.PROCESSED] * 20]
    assert deadlocks == []
    events = pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')}")
    assert events == 40
    # One batch took every key before the other (destination: the consumer's side).
    first_sides = pg.scalar(
        "SELECT count(DISTINCT first) FROM (SELECT key, (array_agg(destination ORDER BY id))[1]"
        f" AS first FROM {pg.name('outbox')} GROUP BY key) AS f"
    )
    assert first_sides == 1


def test_a_held_back_event_is_written_only_with_its_commit(pg: Database) -> None:
    """A batch whose second handler fails: nothing of the first handler's held-back event
    stands from the failed attempt; the events of the messages that commit are there once."""
    outbox = Outbox(pg.tables)
    dedup = Deduplicator(pg.engine, consumer="locks", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "accounts", message.body, key="same")
        if message.id == "m-1":
            raise ValueError("poison")

    batch = [Message(id=f"m-{i}", body=b"x") for i in range(3)]
    assert handle.batch(batch) == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('outbox')} WHERE key = 'same'") == 2


def test_an_event_added_in_a_rolled_back_savepoint_is_not_written(pg: Database) -> None:
    """Inside ``begin_nested()`` an event is written at once, so that the savepoint's
    rollback takes it away; a held-back row would have outlived it."""
    outbox = Outbox(pg.tables)
    dedup = Deduplicator(pg.engine, consumer="locks", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "kept", b"x", key="k")
        try:
            with session.begin_nested():
                outbox.add(session, "undone", b"x", key="k")
                raise ValueError("undo the savepoint")
        except ValueError:
            pass

    assert handle.batch([Message(id="m-0", body=b"x")]) == [Outcome.PROCESSED]
    destinations = pg.scalar(f"SELECT string_agg(destination, ',') FROM {pg.name('outbox')}")
    assert destinations == "kept"


def test_events_of_one_key_keep_their_order_around_a_savepoint(pg: Database) -> None:
    outbox = Outbox(pg.tables)
    dedup = Deduplicator(pg.engine, consumer="locks", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "first", b"x", key="k")  # held back
        with session.begin_nested():
            outbox.add(session, "second", b"x", key="k")  # written at once, after "first"
        outbox.add(session, "third", b"x", key="k")

    assert handle.batch([Message(id="m-0", body=b"x")]) == [Outcome.PROCESSED]
    order = pg.scalar(f"SELECT string_agg(destination, ',' ORDER BY id) FROM {pg.name('outbox')}")
    assert order == "first,second,third"


def test_asyncio_a_rolled_back_savepoint_takes_its_held_back_event(pg: Database) -> None:
    import asyncio

    from consumerdedup import AsyncDeduplicator

    outbox = Outbox(pg.tables)
    engine = pg.async_engine()
    dedup = AsyncDeduplicator(engine, consumer="locks", tables=pg.tables)

    @dedup.bulk_handler
    async def handle(messages: list[Message], session: Any) -> None:
        await outbox.add(session, "kept", b"x", key="k")
        try:
            async with session.begin_nested():
                await outbox.add(session, "undone", b"x", key="k")
                raise ValueError("undo the savepoint")
        except ValueError:
            pass
        await outbox.add(session, "after", b"x", key="k")

    async def run() -> list[Outcome]:
        try:
            return await handle.batch([Message(id="m-0", body=b"x")])
        finally:
            await engine.dispose()

    assert asyncio.run(run()) == [Outcome.PROCESSED]
    order = pg.scalar(f"SELECT string_agg(destination, ',' ORDER BY id) FROM {pg.name('outbox')}")
    assert order == "kept,after"


def test_bulk_batches_over_the_same_ids_wait_on_the_claim(
    pg: Database, deadlocks: list[str]
) -> None:
    """The claim's rows go in key order: the same 20 ids in opposite orders, many times."""
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, consumer="locks", tables=pg.tables)
    insert = text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)")

    @dedup.bulk_handler
    def handle(messages: list[Message], session: Any) -> None:
        session.execute(insert, [{"m": m.id} for m in messages])

    def process(batch: list[Message]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for round_ in range(10):
            again = [Message(id=f"r{round_}-{m.body.decode()}", body=m.body) for m in batch]
            outcomes += handle.batch(again)
        return outcomes

    results = run_two(process)
    assert deadlocks == []
    outcomes = results[0] + results[1]
    assert outcomes.count(Outcome.PROCESSED) == outcomes.count(Outcome.DUPLICATE) == 200
    applied = pg.scalar(f"SELECT count(DISTINCT message_id) FROM {ledger}")
    assert applied == pg.scalar(f"SELECT count(*) FROM {ledger}") == 200


def test_a_reused_session_writes_at_once_after_the_pipeline(pg: Database) -> None:
    """A session factory that hands out one session (scoped_session): after the pipeline's
    attempt, and after a failed one, Outbox.add on it writes at once again."""
    from sqlalchemy.orm import Session

    shared = Session(pg.engine, expire_on_commit=False)
    outbox = Outbox(pg.tables)
    dedup = Deduplicator(
        pg.engine, consumer="locks", tables=pg.tables, session_factory=lambda: shared
    )

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        outbox.add(session, "in-handler", b"x", key="k")
        if message.id == "bad":
            raise PermanentError("refused")

    assert handle.batch([Message(id="bad", body=b"x")]) == [Outcome.FAILED]
    assert handle.batch([Message(id="good", body=b"x")]) == [Outcome.PROCESSED]
    with shared.begin():
        outbox.add(shared, "outside", b"x", key="k")
    shared.close()
    order = pg.scalar(f"SELECT string_agg(destination, ',' ORDER BY id) FROM {pg.name('outbox')}")
    assert order == "in-handler,outside"
