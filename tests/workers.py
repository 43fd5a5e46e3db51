"""Code that runs in child processes: racing consumers and consumers that die mid-pipeline.

Kept importable (no fixtures) because the children are started with 'spawn'.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Tables

CRASH_EXIT = 99


Names = tuple[str, str, bool]
"""processed_events, outbox, and whether processed_events is partitioned."""


def _deduplicator(url: str, names: Names, ledger: str, **options: Any) -> Any:
    connect_args = {"timeout": 60} if url.startswith("sqlite") else {}
    engine = create_engine(url, connect_args=connect_args)
    events, outbox, partitioned = names
    tables = Tables.define(events, outbox, partitioned=partitioned)
    dedup = Deduplicator(engine, consumer="ledger", tables=tables, **options)

    def insert(message: Message, session: Session) -> None:
        data = message.json()
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:a, :n, :m)"),
            {"a": data["account"], "n": data["amount"], "m": message.id},
        )

    return engine, dedup, insert


def race(
    url: str,
    names: Names,
    ledger: str,
    bodies: dict[str, bytes],
    copies: int,
    seed: int,
    start_at: float,
    claim_first: bool = True,
) -> dict[str, int]:
    """Deliver every id ``copies`` times, shuffled, one message per transaction."""
    engine, dedup, insert = _deduplicator(url, names, ledger)
    handle = dedup.handler(claim_first=claim_first)(insert)
    deliveries = [mid for mid in bodies for _ in range(copies)]
    random.Random(seed).shuffle(deliveries)
    time.sleep(max(0.0, start_at - time.time()))  # all workers start together
    outcomes: Counter[str] = Counter()
    for mid in deliveries:
        outcomes[handle(Message(id=mid, body=bodies[mid])).value] += 1
    engine.dispose()
    return dict(outcomes)


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
