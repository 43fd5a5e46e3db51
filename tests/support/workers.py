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
    connect_args = {"timeout": 60} if url.startswith("sqlite") else {}
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


_start_together: Any = None
"""The barrier of this worker's race (``start_together``)."""


def start_together(barrier: Any) -> None:
    """A race's pool initializer: every worker waits at ``barrier`` before its first
    delivery, so they all begin at once however long each took to start."""
    global _start_together
    _start_together = barrier


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

    ``unlocked``: the partitioned claim's advisory lock is taken out (``no_claim_lock``).
    Returns the outcome counts, the handler's calls, and for each delivery the id, outcome,
    when its first transaction began and when its last COMMIT was sent (None if none was),
    in time.monotonic (one clock for every process of this machine).
    """
    if unlocked:
        partitioned_statements.lock = no_claim_lock  # read when the Deduplicator is built
    engine, dedup, insert = _deduplicator(url, names, ledger)
    handle = dedup.handler(claim_first=claim_first)(insert)
    ids = list(bodies)
    if seed is None:  # ``copies`` passes over the ids: each worker meets the others at each
        deliveries = [mid for _ in range(copies) for mid in ids]
    else:  # shuffled within blocks of ids that the workers go through together
        rng, deliveries = random.Random(seed), []
        for start in range(0, len(ids), block):
            chunk = [mid for mid in ids[start : start + block] for _ in range(copies)]
            rng.shuffle(chunk)
            deliveries += chunk
    assert _start_together is not None, "a race's pool has start_together as initializer"
    _start_together.wait(timeout=120)  # all workers start together
    outcomes: Counter[str] = Counter()
    timeline: list[tuple[str, str, float, float | None]] = []
    begins, commits = insert.begins, insert.commits
    for mid in deliveries:
        first, committed = len(begins), len(commits)
        outcome = handle(Message(id=mid, body=bodies[mid])).value
        last_commit = commits[-1] if len(commits) > committed else None
        timeline.append((mid, outcome, begins[first], last_commit))
        outcomes[outcome] += 1
    engine.dispose()
    return {"outcomes": dict(outcomes), "calls": len(insert.calls), "timeline": timeline}


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
