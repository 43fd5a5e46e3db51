"""Round 5: Outbox.add's arguments, now that a keyed event in a dedup handler on PostgreSQL
is written only at COMMIT (held back), and the relay publishes windows.

A lone surrogate in a destination, key or header cannot be stored (destination, key) or
published (a header: PostgreSQL's json column takes it, no broker client encodes it). It is
refused at ``add``: that message alone FAILED with the reason, nothing of it written, its
batch-mates committed; and outside a handler (a plain session) ``add`` still writes at once.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Deduplicator, Message, Outbox, Outcome
from tests.conftest import Database

BAD = "x\udc00"


def _args(where: str) -> dict[str, Any]:
    if where == "destination":
        return {"destination": BAD, "key": "k"}
    if where == "key":
        return {"destination": "orders", "key": BAD}
    return {"destination": "orders", "key": "k", "headers": {"h": BAD}}


@pytest.mark.parametrize("where", ["destination", "key", "header"])
def test_a_lone_surrogate_fails_its_message_alone_at_add(db: Database, where: str) -> None:
    outbox = Outbox(db.tables)

    def handler(message: Message, session: Any) -> None:
        if message.id == "m2":
            outbox.add(session, body=b"bad", **_args(where))
        else:
            outbox.add(session, "orders", message.id.encode(), key="k")

    dedup = Deduplicator(db.engine, "round5", tables=db.tables)
    results = dedup.handler(handler).process_batch(
        [Message(id=f"m{i}", body=json.dumps(i).encode()) for i in range(4)]
    )
    assert [r.outcome for r in results] == [Outcome.PROCESSED] * 2 + [Outcome.FAILED] + [
        Outcome.PROCESSED
    ]
    assert "lone surrogate" in str(results[2].reason)
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        bodies = conn.execute(select(ob.c.body).order_by(ob.c.id)).scalars().all()
    assert [bytes(b) for b in bodies] == [b"m0", b"m1", b"m3"]


def test_add_on_a_plain_session_writes_at_once_and_refuses_at_once(db: Database) -> None:
    outbox = Outbox(db.tables)
    ob = db.tables.outbox
    with Session(db.engine) as session, session.begin():
        outbox.add(session, "orders", b"plain", key="k")
        seen = session.execute(select(func.count()).select_from(ob)).scalar()
        assert seen == 1  # not held back: no pipeline transaction
        with pytest.raises(ConfigurationError, match="lone surrogate"):
            outbox.add(session, "orders", b"bad", key="k", headers={"h": BAD})
    with db.engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(ob)).scalar() == 1
