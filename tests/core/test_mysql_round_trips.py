"""What the pipeline sends on MariaDB through PyMySQL (issue 34): our statements as driver
SQL (mysql_claim), and no pool ROLLBACK after a COMMIT that left nothing to undo
(verified_commit), unless something went out in between."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import Deduplicator, Message, Outcome
from tests.conftest import Database


@pytest.fixture
def one_connection(mariadb: Database) -> Iterator[Any]:
    """An engine of one pooled connection: every session of the test is on it."""
    engine = create_engine(mariadb.url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def sent(engine: Any) -> dict[str, int]:
    """The pooled connection's own statement counters (its checkout and return included)."""
    with engine.connect() as conn:
        found = conn.exec_driver_sql(
            "SHOW SESSION STATUS WHERE Variable_name IN ('Com_commit', 'Com_rollback', "
            "'Com_insert', 'Com_select')"
        ).all()
    return {name: int(value) for name, value in found}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before[name] for name in before}


def read_back(engine: Any) -> dict[str, int]:
    """What one read of ``sent`` costs itself: its SELECT and its return's ROLLBACK."""
    first = sent(engine)
    return delta(first, sent(engine))


def test_a_message_costs_its_statements_and_no_rollback(
    mariadb: Database, one_connection: Any
) -> None:
    """Claim, the handler's INSERT, the claim check, COMMIT: four statements a message, as
    plain PyMySQL sends them; the pool's ROLLBACK after our COMMIT is not sent."""
    ledger = mariadb.create_ledger()
    dedup = Deduplicator(one_connection, "c", tables=mariadb.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})

    assert handle(Message(id="warm", body=b"x")) is Outcome.PROCESSED  # server checks, once
    reading = read_back(one_connection)
    before = sent(one_connection)
    assert [handle(Message(id=f"m{i}", body=b"x")) for i in range(3)] == [Outcome.PROCESSED] * 3
    used = delta(before, sent(one_connection))
    ours = {name: used[name] - reading[name] for name in used}
    assert ours == {"Com_commit": 3, "Com_rollback": 0, "Com_insert": 6, "Com_select": 3}
    assert handle(Message(id="m1", body=b"x")) is Outcome.DUPLICATE
    assert mariadb.scalar(f"SELECT count(*) FROM {ledger}") == 4


def test_a_statement_after_the_commit_puts_the_rollback_back(
    mariadb: Database, one_connection: Any
) -> None:
    """A statement sent on the connection after our COMMIT (here an after_commit hook's
    INSERT) opens a transaction: the pool's ROLLBACK is sent and undoes it, so the
    connection goes back to the pool with nothing of it pending."""
    ledger = mariadb.create_ledger()
    raws: list[Any] = []

    class Hooked(Session):
        pass

    def after_commit(session: Session) -> None:
        if raws:
            cursor = raws.pop().cursor()
            cursor.execute(f"INSERT INTO {ledger} (message_id) VALUES ('stray')")
            cursor.close()

    event.listen(Hooked, "after_commit", after_commit)
    dedup = Deduplicator(
        one_connection,
        "c",
        tables=mariadb.tables,
        session_factory=sessionmaker(one_connection, class_=Hooked),
    )

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        raws.append(session.connection().connection.driver_connection)

    assert handle(Message(id="m", body=b"x")) is Outcome.PROCESSED
    with one_connection.connect() as conn:  # the same connection, as the pool gives it
        stray = f"SELECT count(*) FROM {ledger} WHERE message_id = 'stray'"
        seen = conn.exec_driver_sql(stray).scalar()  # its own uncommitted row, if left open
    assert seen == 0
    assert mariadb.scalar(f"SELECT count(*) FROM {ledger}") == 1  # the message's row alone
