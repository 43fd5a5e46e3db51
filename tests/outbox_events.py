"""Filling the outbox the way the broker outbox tests need it."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from consumerdedup import Outbox


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
