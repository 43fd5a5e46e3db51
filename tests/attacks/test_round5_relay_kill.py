"""Round 5: the pipelined relay killed (the process gone, as SIGKILL leaves it) after a
window's confirms came back and before the round marked them published.

Those events are on the broker but unmarked: the next relay sends them again (repeats are
fine, consumers dedup by event_id); none is lost, and each key's first copies stay in order.
On PostgreSQL and MariaDB the killed round's claim and row locks go with its connection (the
server rolls back when the socket closes); on SQLite the round had read and committed, so
the rows were never marked."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select

from consumerdedup import OutboxRelay, RelayConfig
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from tests.conftest import Database, database
from tests.rabbitmq.test_relay_window import add, first_copies, in_key_order
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

NOW = RelayConfig(batch_size=100, initial_backoff=timedelta(0), max_backoff=timedelta(0))


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


class DiesAfterConfirms(RabbitPublisher):
    def publish_window(self, messages: Any) -> Any:
        outcomes = super().publish_window(messages)
        if all(outcome is None for outcome in outcomes):
            os._exit(9)  # no cleanup, no rollback sent: the process is just gone
        return outcomes


def _relay_that_dies(url: str, tables: Any, amqp: str) -> None:
    engine = create_engine(url)
    with OutboxRelay(engine, DiesAfterConfirms(amqp), tables=tables, config=NOW) as relay:
        relay.run_once()


def test_a_relay_killed_between_confirms_and_marks_loses_nothing(
    db: Database, rabbit: Broker
) -> None:
    queue = rabbit.queue("killed", dead_letter=False)
    add(db, [(queue, key, f"{key}{seq}") for seq in range(1, 6) for key in "abc"])
    db.engine.dispose()  # no pooled connection crosses the fork
    child = multiprocessing.get_context("fork").Process(
        target=_relay_that_dies, args=(db.url, db.tables, rabbit.url)
    )
    child.start()
    child.join(30)
    assert child.exitcode == 9
    assert len(rabbit.peek(queue)) == 15  # all confirmed by the broker before the kill
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        marked = conn.execute(select(func.count()).where(ob.c.published_at.is_not(None)))
        assert marked.scalar() == 0
    with OutboxRelay(db.engine, RabbitPublisher(rabbit.url), tables=db.tables, config=NOW) as r:
        assert r.drain() == 15
        assert r.backlog() == 0
    held = first_copies(rabbit, queue)
    assert sorted(held) == sorted(f"{k}{s}" for s in range(1, 6) for k in "abc")
    assert in_key_order(held), held
    assert len(rabbit.peek(queue)) == 30  # each sent twice: at least once, never lost
