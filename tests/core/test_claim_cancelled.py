"""A twin's claim cancelled by statement_timeout while it waits on the holder's row lock.

The claim of a key another transaction holds waits until that transaction ends. Cancelled
there (57014, statement_timeout), the twin met contention, not a fault of its message: it
must end RETRY (delivered again later) with nothing recorded by it, never FAILED (which
would dead-letter a message its holder is processing), and the holder commits it once.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, RetryPolicy
from consumerdedup.errors import RetryLater
from tests.conftest import Database

pytestmark = pytest.mark.postgres

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


@pytest.mark.parametrize("bulk", [False, True], ids=["handler", "bulk"])
def test_a_claim_cancelled_while_its_twin_holds_the_key_is_retried_not_failed(
    pg: Database, bulk: bool
) -> None:
    ledger = pg.create_ledger()
    holding, release = threading.Event(), threading.Event()
    holder_dedup = Deduplicator(pg.engine, "c", tables=pg.tables, retry=FAST)
    impatient = create_engine(pg.url, connect_args={"options": "-c statement_timeout=300"})
    twin_dedup = Deduplicator(impatient, "c", tables=pg.tables, retry=FAST)
    insert = text(f"INSERT INTO {ledger} (message_id) VALUES (:m)")

    @holder_dedup.handler
    def hold(message: Message, session: Session) -> None:
        session.execute(insert, {"m": message.id})
        holding.set()
        assert release.wait(30)

    def write(messages: list[Message], session: Session) -> None:
        session.execute(insert, [{"m": m.id} for m in messages])

    twin = (
        twin_dedup.bulk_handler(write)
        if bulk
        else twin_dedup.handler(lambda message, session: write([message], session))
    )
    held: list[Outcome] = []
    worker = threading.Thread(target=lambda: held.append(hold(Message(id="k1", body=b"{}"))))
    worker.start()
    try:
        assert holding.wait(30)
        result = twin.process(Message(id="k1", body=b"{}"))
    finally:
        release.set()
        worker.join(30)
        impatient.dispose()
    assert result.outcome is Outcome.RETRY, result.reason
    assert isinstance(result.error, RetryLater) and "cancelled" in result.reason
    assert held == [Outcome.PROCESSED]
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1
    events = pg.tables.processed_events.fullname
    assert pg.scalar(f"SELECT count(*) FROM {events} WHERE message_id = 'k1'") == 1
    assert twin.process(Message(id="k1", body=b"{}")).outcome is Outcome.DUPLICATE
