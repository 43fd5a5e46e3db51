"""Filling the outbox the way the broker outbox tests need it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import DedupHandler, Deduplicator, Message, Outbox, OutboxRelay


def add_events(db: Any, destination: str, count: int, keys: int, chunk: int = 500) -> list[str]:
    """``count`` events over ``keys`` keys; body ``key:seq`` with seq counting per key."""
    outbox = Outbox(db.tables)
    ids = []
    for start in range(0, count, chunk):
        with Session(db.engine) as session, session.begin():
            for n in range(start, min(start + chunk, count)):
                body = f"k{n % keys}:{n // keys}".encode()
                ids.append(outbox.add(session, destination, body, key=f"k{n % keys}"))
    return ids


@contextmanager
def running(relays: Sequence[OutboxRelay]) -> Iterator[None]:
    """Each relay's ``run()`` in a thread of its own; stopped and joined on the way out,
    whatever the block raised."""
    threads = [threading.Thread(target=relay.run) for relay in relays]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        for relay in relays:
            relay.stop()
        for thread in threads:
            thread.join(30)


STALL = 10.0
"""Seconds a background relay may go without shrinking its backlog before a test calls it
stuck (its rounds back off 0.5 s at most in these tests)."""


def assert_drained(relay: OutboxRelay, timeout: float = 60.0, stall: float = STALL) -> None:
    """Wait until the background ``relay`` has published every committed row; fail within
    ``stall`` seconds of no progress (not after the whole ``timeout``), saying where it is."""
    deadline = time.monotonic() + timeout
    backlog, since = relay.backlog(), time.monotonic()
    while backlog > 0:
        relay.wait_drained(0.2)
        now, left = time.monotonic(), relay.backlog()
        if left != backlog:
            backlog, since = left, now
        stuck = now - since >= stall
        if stuck or now >= deadline:
            raise AssertionError(
                f"the relay is {'stuck' if stuck else 'too slow'}: {backlog} rows left after "
                f"{now - since:.0f} s without progress, {relay.published} published, "
                f"parked {relay.parked()[:3]}"
            )


class Downstream:
    """The consumer after the relay: applies ``key:seq`` events into a ledger, deduplicated by
    event_id; the ledger's serial column records the order they were applied in."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self.ledger = db.name("applied")
        with db.engine.begin() as conn:
            conn.execute(
                # ``event_key``: KEY is a reserved word on MySQL and MariaDB.
                text(
                    f"CREATE TABLE {self.ledger} (n SERIAL, event_key TEXT, seq INT, event_id TEXT)"
                )
            )
        dedup = Deduplicator(db.engine, consumer="downstream", tables=db.tables)
        self.handler: DedupHandler = dedup.handler(self._apply)

    def _apply(self, message: Message, session: Session) -> None:
        key, seq = message.body.decode().split(":")
        session.execute(
            text(f"INSERT INTO {self.ledger} (event_key, seq, event_id) VALUES (:k, :s, :e)"),
            {"k": key, "s": int(seq), "e": message.id},
        )

    def applied(self) -> list[tuple[str, int, str]]:
        """(key, seq, event_id) in the order applied."""
        with self.db.engine.connect() as conn:
            rows = conn.execute(
                text(f"SELECT event_key, seq, event_id FROM {self.ledger} ORDER BY n")
            )
            return [(str(k), int(s), str(e)) for k, s, e in rows]
