"""Batches sharing keys on the partitioned table cannot deadlock (README, "Partitioned
processed_events"): the claim's advisory locks are taken in hash order, not in the order the
keys arrive.

Two batches that lock the same keys in two orders deadlock only if both are part-way through
their locks at once, a window of microseconds left to chance. The test does not leave it to
chance: a blocker holds the claim lock of one shared key (``PIVOT``), and the workers are
started one after the other, each only once the previous one waits on a lock, so each holds
every lock it took before reaching a key someone else holds. Then the blocker lets go.

Taken in arrival order, that is a certain deadlock: the worker going forward holds the keys
before ``PIVOT``, the one going backward those after it, both wait on ``PIVOT``, and whoever
gets it next waits on the other (PostgreSQL reports 40P01 after ``deadlock_timeout``, 1 s).
Taken in hash order every worker waits on the lowest-hashed key it lacks, so nobody waits
while holding a key someone ahead of it needs.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome
from consumerdedup.dedup import partitioned_statements
from tests.conftest import Database

pytestmark = pytest.mark.postgres

CONSUMER = "ledger"
KEYS = [f"k{i:03d}" for i in range(48)]
PIVOT = "k020"
"""Held by the blocker; in every worker's key set, in the middle of the first two."""
ORDERS = {
    "forward": KEYS[:40],
    "backward": KEYS[:40][::-1],
    "shuffled": random.Random(7).sample(KEYS[8:], 40),  # overlaps, 8 keys of its own
    "evens": random.Random(11).sample(KEYS[::2], 24),
}
HOLD = 0.005
"""Seconds the handler sleeps per message it processes: the claim's transaction stays open
about 0.2 s for a batch of 40, so the other batches really wait on its locks."""
DEADLINE = 10.0
"""Seconds for anything to happen; all of it takes well under 2 s (a deadlock costs 1 s)."""


APP = f"claim-order-{uuid.uuid4().hex[:8]}"
"""The workers' application_name: pg_stat_activity then shows this test's connections only."""


@pytest.fixture
def engine(pg_partitioned: Database) -> Iterator[Engine]:
    engine = create_engine(pg_partitioned.url, pool_size=8, connect_args={"application_name": APP})
    with engine.begin() as conn:
        conn.execute(
            text(f"CREATE TABLE {pg_partitioned.schema}.business (message_id text, worker text)")
        )
    try:
        yield engine
    finally:
        engine.dispose()


def wait_for_waiters(engine: Engine, count: int) -> None:
    """Until ``count`` of the workers' connections wait on an advisory lock at once."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = :app "
        "AND wait_event_type = 'Lock' AND wait_event = 'advisory'"
    )
    deadline = time.monotonic() + DEADLINE
    with engine.connect() as conn:
        while conn.execute(query, {"app": APP}).scalar_one() < count:
            conn.rollback()  # pg_stat_activity is read once per transaction
            assert time.monotonic() < deadline, f"fewer than {count} workers ever waited"
            time.sleep(0.005)


def test_batches_sharing_keys_in_opposite_orders_do_not_deadlock(
    pg_partitioned: Database, engine: Engine
) -> None:
    db = pg_partitioned
    deadlocks: list[str] = []

    @event.listens_for(engine, "handle_error")
    def count_deadlocks(context: Any) -> None:
        if getattr(context.original_exception, "sqlstate", None) == "40P01":
            deadlocks.append(str(context.original_exception))

    dedup = Deduplicator(engine, CONSUMER, tables=db.tables)

    def work(worker: str, keys: list[str]) -> list[Outcome]:
        def handler(message: Message, session: Session) -> None:
            session.execute(
                text(f"INSERT INTO {db.schema}.business VALUES (:m, :w)"),
                {"m": message.id, "w": worker},
            )
            time.sleep(HOLD)

        messages = [Message(id=key, body=b'{"n": 1}') for key in keys]
        return dedup.handler(handler).batch(messages)

    results: dict[str, Any] = {}

    def run(worker: str, keys: list[str]) -> None:
        try:
            results[worker] = work(worker, keys)
        except BaseException as exc:  # reported below, not lost in the thread
            results[worker] = exc

    lock = partitioned_statements.lock(db.tables.processed_events)
    threads: list[threading.Thread] = []
    with engine.connect() as blocker:
        blocker.execute(lock, {"consumer": CONSUMER, "keys": [PIVOT]})  # held until rollback
        try:
            for waiting, (worker, keys) in enumerate(ORDERS.items(), start=1):
                thread = threading.Thread(target=run, args=(worker, keys), daemon=True)
                thread.start()
                threads.append(thread)
                # Each worker has taken every lock it could and waits before the next starts:
                # the waits overlap for certain, every one of them on a claim lock.
                wait_for_waiters(engine, waiting)
        finally:
            blocker.rollback()
        for thread in threads:
            thread.join(DEADLINE)
    assert not any(thread.is_alive() for thread in threads), "a worker never finished"

    assert deadlocks == [], "batches sharing keys deadlocked (and were retried)"
    for worker, outcomes in results.items():
        assert not isinstance(outcomes, BaseException), f"{worker}: {outcomes!r}"
        assert set(outcomes) <= {Outcome.PROCESSED, Outcome.DUPLICATE}, (worker, outcomes)
    distinct = {key for keys in ORDERS.values() for key in keys}
    processed = sum(o is Outcome.PROCESSED for outcomes in results.values() for o in outcomes)
    assert processed == len(distinct)
    with engine.connect() as conn:
        recorded = conn.execute(
            text(f"SELECT message_id FROM {db.schema}.processed_events")
        ).scalars()
        assert sorted(recorded) == sorted(distinct)
        business = conn.execute(text(f"SELECT message_id FROM {db.schema}.business")).scalars()
        assert sorted(business) == sorted(distinct)
