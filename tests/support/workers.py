"""Code that runs in child processes: racing consumers and consumers that die mid-pipeline.

Kept importable (no fixtures): the children are forked from a fresh forkserver process
that has imported this module (and with it consumerdedup and SQLAlchemy) once, so a child
starts in milliseconds instead of importing everything again as under 'spawn'.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from datetime import timedelta
from typing import Any

from sqlalchemy import Integer, String, TextualSelect, create_engine, event, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, RetryLater, RetryPolicy, Tables
from consumerdedup.dedup import partitioned_statements

CRASH_EXIT = 99


Names = tuple[str, str, bool]
"""processed_events, outbox, and whether processed_events is partitioned."""


def _deduplicator(url: str, names: Names, ledger: str, **options: Any) -> Any:
    connect_args: dict[str, Any] = {"timeout": 60} if url.startswith("sqlite") else {}
    if url.startswith("postgresql"):  # the race's sessions, told apart in pg_stat_activity
        connect_args["application_name"] = f"race-{ledger}"
    engine = create_engine(url, connect_args=connect_args)
    events, outbox, partitioned = names
    tables = Tables.define(events, outbox, partitioned=partitioned)
    dedup = Deduplicator(engine, consumer="ledger", tables=tables, **options)
    calls: list[str] = []

    def insert(message: Message, session: Session) -> None:
        calls.append(message.id)
        data = message.json()
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:a, :n, :m)"),
            {"a": data["account"], "n": data["amount"], "m": message.id},
        )

    insert.calls = calls  # type: ignore[attr-defined]
    begins: list[float] = []  # when each of the pipeline's transactions began
    event.listen(engine, "begin", lambda conn: begins.append(time.monotonic()))
    insert.begins = begins  # type: ignore[attr-defined]
    commits: list[float] = []  # when each COMMIT was about to be sent
    event.listen(engine, "commit", lambda conn: commits.append(time.monotonic()))
    insert.commits = commits  # type: ignore[attr-defined]
    return engine, dedup, insert


def no_claim_lock(table: Any) -> TextualSelect:
    """The partitioned claim's lock statement with the lock taken out: it reads the isolation
    level as the real one does and locks nothing."""
    return text(
        "SELECT current_setting('transaction_isolation') AS isolation, "
        "cardinality(CAST(:keys AS text[])) AS locked, CAST(:consumer AS text) AS consumer"
    ).columns(isolation=String(), locked=Integer(), consumer=String())


REDELIVERIES = 20
"""A race worker delivers a message that ended RETRY again, as a broker would, up to this
many times in all: the totals count each delivery's final outcome. A RETRY is the answer
to contention (a lock wait that timed out while 20 processes share 2 cores), not a fault;
the invariants are checked on the tables, and ``redelivered`` says how often it came."""

_start_together: Any = None
"""The barrier of this worker's race (``start_together``)."""
_write_lock_asked: Any = None
"""A semaphore of this worker's race, or None: on SQLite, shuffled, each worker releases it
once, when its first BEGIN IMMEDIATE starts running inside SQLite (``_announce_on_sqlite``)."""


def start_together(barrier: Any, write_lock_asked: Any = None) -> None:
    """A race's pool initializer: every worker waits at ``barrier`` before its first
    delivery, so they all begin at once however long each took to start.
    ``write_lock_asked``: a semaphore (at 0) the shuffled SQLite race meets by."""
    global _start_together, _write_lock_asked
    _start_together = barrier
    _write_lock_asked = write_lock_asked


def race(
    url: str,
    names: Names,
    ledger: str,
    bodies: dict[str, bytes],
    copies: int,
    seed: int | None,
    claim_first: bool = True,
    unlocked: bool = False,
    block: int = 100,
) -> dict[str, Any]:
    """Deliver every id ``copies`` times, one message per transaction: shuffled by ``seed``
    within blocks of ``block`` ids (the workers start together and go through the blocks at
    about the same pace, so twins meet often), or with ``seed=None`` in the same order in
    every worker (twins meet at nearly every id).

    Shuffled, every worker delivers the first id first and the first id's twins meet there
    by construction, not by the scheduler's luck (``_meet_shuffled``).

    ``unlocked``: the partitioned claim's advisory lock is taken out (``no_claim_lock``).
    Returns the outcome counts, the handler's calls, and for each delivery the id, outcome,
    when its first transaction began and when its last COMMIT was sent (None if none was),
    in time.monotonic (one clock for every process of this machine).
    """
    if unlocked:
        partitioned_statements.lock = no_claim_lock  # read when the Deduplicator is built
    engine, dedup, insert = _deduplicator(url, names, ledger)
    ids = list(bodies)
    meet = seed is None  # in lockstep every worker delivers ids[0] first
    if meet:
        handler = _meet_at_first_id(insert, ids[0], engine, ledger, unlocked)
    else:  # shuffled: twins meet by construction at ids[0], delivered first
        handler = _meet_shuffled(insert, ids[0], engine, url, ledger, claim_first)
    announce = _announce_on_sqlite(engine) if url.startswith("sqlite") and not meet else None
    handle = dedup.handler(claim_first=claim_first)(handler)
    if seed is None:  # ``copies`` passes over the ids: each worker meets the others at each
        deliveries = [mid for _ in range(copies) for mid in ids]
    else:  # shuffled within blocks of ids that the workers go through together
        rng, deliveries = random.Random(seed), []
        for start in range(0, len(ids), block):
            chunk = [mid for mid in ids[start : start + block] for _ in range(copies)]
            rng.shuffle(chunk)
            deliveries += chunk
    if not meet:
        deliveries.remove(ids[0])
        deliveries.insert(0, ids[0])
    assert _start_together is not None, "a race's pool has start_together as initializer"
    _start_together.wait(timeout=120)  # all workers start together
    if announce is not None:
        announce()  # from here on: the first BEGIN IMMEDIATE is the first id's
    outcomes: Counter[str] = Counter()
    timeline: list[tuple[str, str, float, float | None]] = []
    begins, commits = insert.begins, insert.commits
    redelivered = 0
    for mid in deliveries:
        first, committed = len(begins), len(commits)
        outcome = handle(Message(id=mid, body=bodies[mid])).value
        while outcome == "retry" and redelivered < REDELIVERIES:  # as a broker would
            redelivered += 1
            outcome = handle(Message(id=mid, body=bodies[mid])).value
        last_commit = commits[-1] if len(commits) > committed else None
        timeline.append((mid, outcome, begins[first], last_commit))
        outcomes[outcome] += 1
    engine.dispose()
    return {
        "outcomes": dict(outcomes),
        "calls": len(insert.calls),
        "timeline": timeline,
        "redelivered": redelivered,
    }


def _meet_at_first_id(insert: Any, first_id: str, engine: Any, ledger: str, unlocked: bool) -> Any:
    """``insert`` whose call for the first id (in lockstep every worker delivers it first)
    holds until its twins are there, so the race's twins meet by construction, not by the
    scheduler's luck (on 2 busy cores they once never met, and a CI run failed on it).

    With the claim's lock every twin waits on it: the call holds until PostgreSQL shows
    one of the race's sessions waiting on a lock. With the lock taken out nothing keeps
    twins apart: every worker is inside this call at once, at the race's barrier."""

    def handler(message: Message, session: Session) -> None:
        if message.id == first_id:
            if unlocked:
                assert _start_together is not None
                _start_together.wait(timeout=60)  # a lock that still held would break this
            else:
                _await_a_twin_on_the_lock(engine, ledger)
        insert(message, session)

    return handler


def _meet_shuffled(
    insert: Any, first_id: str, engine: Any, url: str, ledger: str, claim_first: bool
) -> Any:
    """``insert`` whose first call in this worker for ``first_id`` (every worker delivers it
    first) holds until a twin of it is in flight, seen, not assumed:

    - MySQL/MariaDB: the caller holds its claim row until InnoDB shows a session of the
      race's database waiting on a lock (``_await_a_twin_on_innodb_lock``, bounded);
    - PostgreSQL, claim-first: the caller holds its claim (the key's row, or the partitioned
      claim's advisory lock) until pg_stat_activity shows one of the race's sessions
      waiting on a lock: a twin blocked on that claim;
    - PostgreSQL, check-first: nothing is locked before the handler (the record is written
      last), so every worker calls it for the first id, and they wait for each other at the
      race's barrier: no twin can have committed, all sixteen are in flight at once, and
      all but one then wait on the first record written;
    - SQLite: the caller holds the database's write lock (its BEGIN IMMEDIATE) until another
      worker's BEGIN IMMEDIATE has started running inside SQLite (``_announce_on_sqlite``):
      that twin cannot get the lock, and so cannot claim, before this caller commits.
    """
    held = False

    def handler(message: Message, session: Session) -> None:
        nonlocal held
        if message.id == first_id and not held:
            held = True
            if url.startswith(("mysql", "mariadb")):
                _await_a_twin_on_innodb_lock(url)
            elif url.startswith("sqlite"):
                _await_a_twin_on_the_write_lock()
            elif claim_first:
                _await_a_twin_on_the_lock(engine, ledger)
            else:
                assert _start_together is not None
                _start_together.wait(timeout=60)
        insert(message, session)

    return handler


def _announce_on_sqlite(engine: Any) -> Any:
    """Trace this worker's SQLite statements; once armed (the function returned), release
    ``_write_lock_asked`` when the worker's first BEGIN IMMEDIATE starts running. SQLite
    calls the trace at the statement's first instruction, inside sqlite3_step, right before
    the write lock is asked for: with the lock held elsewhere, the statement is then in
    SQLite's busy wait until that holder commits."""
    assert _write_lock_asked is not None, "a shuffled SQLite race passes write_lock_asked"
    state = {"armed": False, "told": False}

    def trace(statement: str) -> None:
        if state["armed"] and not state["told"] and statement.startswith("BEGIN IMMEDIATE"):
            state["told"] = True
            _write_lock_asked.release()

    # At every checkout, as the Deduplicator may already hold a pooled connection.
    event.listen(engine, "checkout", lambda dbapi, record, proxy: dbapi.set_trace_callback(trace))

    def arm() -> None:
        state["armed"] = True

    return arm


def _await_a_twin_on_the_write_lock() -> None:
    """Until ``_write_lock_asked`` was released twice: this worker's own BEGIN IMMEDIATE
    (released before it got the lock) and a twin's, asked while this worker holds it."""
    assert _write_lock_asked is not None
    for _ in range(2):
        assert _write_lock_asked.acquire(timeout=60), "no twin asked for the write lock"


def _await_a_twin_on_the_lock(engine: Any, ledger: str) -> None:
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE application_name = :name AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + 60
    with engine.connect() as conn:
        while conn.execute(waiting, {"name": f"race-{ledger}"}).scalar() == 0:
            conn.rollback()  # a fresh snapshot of pg_stat_activity on the next read
            assert time.monotonic() < deadline, "no twin ever waited on the first id's claim"
            time.sleep(0.005)  # polling a condition, not waiting out a guess


def collisions(timelines: list[list[tuple[str, str, float, float | None]]]) -> int:
    """DUPLICATE answers to deliveries whose transaction began before the PROCESSED delivery
    of their id sent its COMMIT: twins that met in flight, so one waited on the other's
    claim (or, checking first, ran its handler too and rolled back)."""
    committed = {
        mid: sent
        for timeline in timelines
        for mid, outcome, _, sent in timeline
        if outcome == "processed" and sent is not None
    }
    return sum(
        1
        for timeline in timelines
        for mid, outcome, started, _ in timeline
        if outcome == "duplicate" and started < committed[mid]
    )


def crash_at(url: str, names: Names, ledger: str, body: bytes, step: str) -> None:
    """Process one message and die (os._exit, no cleanup) at ``step`` of the pipeline."""
    engine, dedup, insert = _deduplicator(url, names, ledger)

    def die() -> None:
        os._exit(CRASH_EXIT)

    def handler(message: Message, session: Session) -> None:
        if step == "before_handler":
            die()
        insert(message, session)
        if step == "in_handler":
            die()

    if step == "after_insert":  # the dedup row is written, COMMIT not yet sent
        event.listen(engine, "commit", lambda conn: die())
    if step == "after_commit":  # committed, but the broker was never acked
        event.listen(Session, "after_commit", lambda session: die())
    dedup.handler(handler)(Message(id="p-1", body=body))
    raise AssertionError(f"step {step!r} never reached")


BATCH_STEPS = ("after_prefix_commit", "in_culprit_alone", "after_culprit_commit")


def crash_in_batch(url: str, names: Names, ledger: str, bodies: list[bytes], step: str) -> None:
    """A batch of b-1..b-5 whose b-3 fails transiently once, so the pipeline commits b-1 and
    b-2, runs b-3 alone, then b-4 and b-5. Die (os._exit) at ``step`` of that sequence."""
    _, dedup, insert = _deduplicator(
        url, names, ledger, retry=RetryPolicy(initial_delay=timedelta(milliseconds=1))
    )
    culprit_calls = 0
    commits = 0

    def die() -> None:
        os._exit(CRASH_EXIT)

    def handler(message: Message, session: Session) -> None:
        nonlocal culprit_calls
        if message.id == "b-3":
            culprit_calls += 1
            if culprit_calls == 2 and step == "in_culprit_alone":
                die()
        insert(message, session)
        if message.id == "b-3" and culprit_calls == 1:
            raise RetryLater("b-3 is not ready yet")

    def after_commit(session: Session) -> None:
        nonlocal commits
        commits += 1
        if (step, commits) in {("after_prefix_commit", 1), ("after_culprit_commit", 2)}:
            die()

    event.listen(Session, "after_commit", after_commit)
    messages = [Message(id=f"b-{i}", body=body) for i, body in enumerate(bodies, start=1)]
    dedup.handler(handler).batch(messages)
    raise AssertionError(f"step {step!r} never reached")


# asyncio: the same race and the same deaths through AsyncDeduplicator -------------------


def _async_deduplicator(url: str, names: Names, ledger: str) -> Any:
    """``_deduplicator``'s twin on an AsyncEngine (``url``: an asyncio driver's URL)."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    from consumerdedup import AsyncDeduplicator

    engine = create_async_engine(url)
    events, outbox, partitioned = names
    tables = Tables.define(events, outbox, partitioned=partitioned)
    dedup = AsyncDeduplicator(engine, consumer="ledger", tables=tables)
    calls: list[str] = []

    async def insert(message: Message, session: AsyncSession) -> None:
        calls.append(message.id)
        data = message.json()
        await session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:a, :n, :m)"),
            {"a": data["account"], "n": data["amount"], "m": message.id},
        )

    insert.calls = calls  # type: ignore[attr-defined]
    begins: list[float] = []
    event.listen(engine.sync_engine, "begin", lambda conn: begins.append(time.monotonic()))
    insert.begins = begins  # type: ignore[attr-defined]
    commits: list[float] = []
    event.listen(engine.sync_engine, "commit", lambda conn: commits.append(time.monotonic()))
    insert.commits = commits  # type: ignore[attr-defined]
    return engine, dedup, insert


def race_async(
    url: str,
    async_url: str,
    names: Names,
    ledger: str,
    bodies: dict[str, bytes],
    copies: int,
    seed: int,
    block: int = 100,
) -> dict[str, Any]:
    """``race`` through AsyncDeduplicator on MySQL/MariaDB: every id ``copies`` times,
    shuffled by ``seed`` within blocks. Every worker delivers the first id first, and the
    first worker's handler for it holds (its claim row locked) until InnoDB shows another
    session of this database waiting on a lock: twins meet by construction. ``url`` (the
    blocking driver's) only serves that look at information_schema.INNODB_TRX."""
    import asyncio

    ids = list(bodies)
    rng, deliveries = random.Random(seed), [ids[0]]
    for start in range(0, len(ids), block):
        chunk = [mid for mid in ids[start : start + block] for _ in range(copies)]
        if start == 0:
            chunk.remove(ids[0])  # delivered first, above
        rng.shuffle(chunk)
        deliveries += chunk
    assert _start_together is not None, "a race's pool has start_together as initializer"

    async def main() -> dict[str, Any]:
        engine, dedup, insert = _async_deduplicator(async_url, names, ledger)
        held = False

        async def handler(message: Message, session: Any) -> None:
            nonlocal held
            if message.id == ids[0] and not held:
                held = True
                await asyncio.to_thread(_await_a_twin_on_innodb_lock, url)
            await insert(message, session)

        handle = dedup.handler(handler)
        _start_together.wait(timeout=120)
        outcomes: Counter[str] = Counter()
        timeline: list[tuple[str, str, float, float | None]] = []
        begins, commits = insert.begins, insert.commits
        redelivered = 0
        for mid in deliveries:
            first, committed = len(begins), len(commits)
            outcome = (await handle(Message(id=mid, body=bodies[mid]))).value
            while outcome == "retry" and redelivered < REDELIVERIES:  # as a broker would
                redelivered += 1
                outcome = (await handle(Message(id=mid, body=bodies[mid]))).value
            last_commit = commits[-1] if len(commits) > committed else None
            timeline.append((mid, outcome, begins[first], last_commit))
            outcomes[outcome] += 1
        await engine.dispose()
        return {
            "outcomes": dict(outcomes),
            "calls": len(insert.calls),
            "timeline": timeline,
            "redelivered": redelivered,
        }

    return asyncio.run(main())


def _await_a_twin_on_innodb_lock(url: str) -> None:
    """Until a session of ``url``'s database waits on an InnoDB row lock (here: a twin's
    claim INSERT on the held claim row). The first worker to claim the first id waits
    here; its twins' claims queue on its row."""
    engine = create_engine(url, poolclass=None)
    waiting = text(
        "SELECT count(*) FROM information_schema.INNODB_TRX t "
        "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
        "WHERE t.trx_state = 'LOCK WAIT' AND p.DB = DATABASE()"
    )
    # Bounded well below innodb_lock_wait_timeout (50 s): a hold that outlasted it timed
    # the twins' claims out (1205) in a loaded CI run. Past the bound the race goes on
    # unmet, and the test's ``collided > 0`` says so.
    deadline = time.monotonic() + 20
    try:
        with engine.connect() as conn:
            while conn.execute(waiting).scalar() == 0 and time.monotonic() < deadline:
                conn.rollback()
                time.sleep(0.005)  # polling a condition, not waiting out a guess
    finally:
        engine.dispose()


def crash_at_async(url: str, names: Names, ledger: str, body: bytes, step: str) -> None:
    """``crash_at`` through AsyncDeduplicator (``url``: an asyncio driver's URL)."""
    import asyncio

    engine, dedup, insert = _async_deduplicator(url, names, ledger)

    def die() -> None:
        os._exit(CRASH_EXIT)

    async def handler(message: Message, session: Any) -> None:
        if step == "before_handler":
            die()
        await insert(message, session)
        if step == "in_handler":
            die()

    if step == "after_insert":  # the dedup row is written, COMMIT not yet sent
        event.listen(engine.sync_engine, "commit", lambda conn: die())
    if step == "after_commit":  # committed, but the broker was never acked
        event.listen(Session, "after_commit", lambda session: die())  # AsyncSession's too
    asyncio.run(dedup.handler(handler)(Message(id="p-1", body=body)))
    raise AssertionError(f"step {step!r} never reached")
