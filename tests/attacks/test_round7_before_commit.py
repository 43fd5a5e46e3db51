"""Between the last handler call and the pipeline's COMMIT: the transaction ended by
something the pipeline cannot see (here the application's own engine listener, rolling
the raw connection back at the held-back outbox INSERT; a handler's thread could do the
same). In the driver's autocommit (the pipelined BEGIN) a statement sent then would
commit alone, and a COMMIT with no transaction commits nothing and raises nothing: the
message would be reported PROCESSED with neither its effects nor its record, or its
outbox event published alone. Both must end as a retry that then processes it once."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, Outcome
from tests.conftest import Database


@pytest.mark.parametrize("when", ["before_cursor_execute", "after_cursor_execute"])
def test_a_rollback_at_the_held_back_outbox_insert_loses_and_publishes_nothing(
    pg: Database, when: str
) -> None:
    ledger = pg.create_ledger()
    engine = create_engine(pg.url, pool_size=1, max_overflow=0)
    outbox_table = pg.name("outbox")
    rolled = {"left": 1}

    @event.listens_for(engine, when)
    def roll_back_once(conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        if (
            rolled["left"]
            and statement.lstrip().upper().startswith("INSERT INTO")
            and ("outbox" in statement)
        ):
            rolled["left"] -= 1
            conn.connection.driver_connection.rollback()

    dedup = Deduplicator(engine, "before-commit", tables=pg.tables)
    outbox = Outbox(pg.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )
        outbox.add(session, "events", message.id.encode(), key="k")  # held back to COMMIT

    result = handle.process(Message(id="m1", body=b"{}"))
    assert rolled["left"] == 0, "the listener ran"
    assert result.outcome is Outcome.PROCESSED and result.attempts == 2, result.reason
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1
    assert pg.scalar(f"SELECT count(*) FROM {outbox_table}") == 1
    assert pg.scalar(f"SELECT count(*) FROM {pg.name('processed_events')}") == 1
    assert handle(Message(id="m1", body=b"{}")) is Outcome.DUPLICATE
    engine.dispose()


def test_the_next_handler_call_of_an_attempt_refuses_a_transaction_ended_in_between(
    pg: Database,
) -> None:
    """One guard serves all of an attempt's handler calls (handler_guard.attempt_call): the
    next call checks the transaction is still open, as nothing else runs between two calls
    that could notice a rollback by a handler's thread. Made certain here by rolling back
    between the two calls by hand."""
    from consumerdedup.dedup.handler_guard import attempt_call, end_calls
    from consumerdedup.errors import TransactionBroken

    with Session(pg.engine) as session:
        session.execute(text("SELECT 1"))  # the attempt's transaction, as a claim opens it
        first = attempt_call(session)
        first.finish()
        first.verify()
        driver: Any = session.connection().connection.driver_connection
        driver.rollback()  # a thread of the first handler's, say
        with pytest.raises(TransactionBroken, match="between two handler calls"):
            attempt_call(session)
        end_calls(session)
        raw: Any = session.connection().connection.driver_connection
        assert not {"cursor", "commit"} & set(vars(raw)), "the guard is lifted"
