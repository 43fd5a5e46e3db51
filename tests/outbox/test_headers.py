"""Outbox headers are str -> str; anything else is refused at ``add``, never turned into text.

None used to arrive as "None" and bytes as their repr (b'...'), silently.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Outbox, OutboxRelay
from consumerdedup.headers import ID_HEADER
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

REFUSED: list[Any] = [
    {"trace": None},
    {"trace": b"abc"},
    {"attempt": 1},
    {1: "one"},
    {b"trace": "abc"},
    [("trace", "abc")],
]


def outbox_rows(db: Database) -> int:
    with db.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(db.tables.outbox)).scalar_one())


@pytest.mark.parametrize("headers", REFUSED, ids=repr)
def test_headers_that_are_not_str_to_str_are_refused(db: Database, headers: Any) -> None:
    outbox = Outbox(db.tables)
    with (
        Session(db.engine) as session,
        session.begin(),
        pytest.raises(ConfigurationError, match="str"),
    ):
        outbox.add(session, "orders", b"{}", headers=headers)
    assert outbox_rows(db) == 0


@pytest.mark.parametrize("headers", REFUSED, ids=repr)
async def test_headers_that_are_not_str_to_str_are_refused_async(
    db: Database, headers: Any
) -> None:
    engine = db.async_engine()
    outbox = Outbox(db.tables)
    try:
        async with AsyncSession(engine) as session, session.begin():
            with pytest.raises(ConfigurationError, match="str"):
                await outbox.add(session, "orders", b"{}", headers=headers)
    finally:
        await engine.dispose()
    assert outbox_rows(db) == 0


def test_str_headers_arrive_as_they_were_given(db: Database) -> None:
    outbox = Outbox(db.tables)
    headers = {"trace": "t-1", "empty": "", "None": "None", "unicode": "é✓"}
    with Session(db.engine) as session, session.begin():
        event_id = outbox.add(session, "orders", b"{}", headers=headers)
    broker = MemoryBroker()
    assert OutboxRelay(db.engine, broker, tables=db.tables).drain() == 1
    [message] = broker.messages("orders")
    assert dict(message.headers) == {**headers, ID_HEADER: event_id}
