"""docs/loops.md's dramatiq recipe: an actor whose body goes through process_once,
keyed by dramatiq's message id (kept by its retries), on a real dramatiq Worker and
PostgreSQL. Dramatiq's StubBroker: the recipe's guarantee is the database's, not the
broker's (a redelivery is a second enqueue of the same message)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, RetryLater, RetryPolicy
from consumerdedup.integrations.process_once import process_once
from tests.conftest import Database

dramatiq = pytest.importorskip("dramatiq")
from dramatiq.brokers.stub import StubBroker  # noqa: E402
from dramatiq.middleware import CurrentMessage  # noqa: E402


@pytest.fixture
def broker() -> Iterator[Any]:
    broker = StubBroker()
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    yield broker
    broker.close()


def _wait(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():
        assert time.monotonic() < deadline, f"not within 20 s: {what}"
        time.sleep(0.01)


def test_actor_redelivered_and_retried_applies_once(pg: Database, broker: Any) -> None:
    ledger = pg.create_ledger()
    # one attempt in process: the RETRY goes back to dramatiq at once
    dedup = Deduplicator(pg.engine, "charge_order", tables=pg.tables, retry=RetryPolicy(attempts=1))
    busy = {"o-2": 1}  # o-2's bank is busy once: RETRY, then dramatiq's own retry
    outcomes: list[tuple[str, Outcome]] = []

    @dedup.handler
    def charge(message: Message, session: Session) -> None:
        order = message.json()
        if busy.get(order["order_id"], 0) > 0:
            busy[order["order_id"]] -= 1
            raise RetryLater("the bank is busy")
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:o, :n, :id)"),
            {"o": order["order_id"], "n": order["amount"], "id": message.id},
        )

    once = process_once(charge)

    # The recipe (docs/loops.md):
    @dramatiq.actor(max_retries=3, min_backoff=10, max_backoff=20)
    def charge_order(order_id: str, amount: int) -> None:
        current = CurrentMessage.get_current_message()
        body = json.dumps({"order_id": order_id, "amount": amount}).encode()
        result = once(Message(id=current.message_id, body=body, source=current.queue_name))
        outcomes.append((order_id, result.outcome))
        if not result.outcome.acks:  # RETRY: nothing recorded; dramatiq retries, same id
            raise RetryLater(result.reason or "retry")

    first = charge_order.send("o-1", 5)
    broker.enqueue(first)  # delivered twice: the same dramatiq message id
    charge_order.send("o-2", 7)
    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=50)
    worker.start()
    try:
        _wait(lambda: len(outcomes) >= 4, "four deliveries decided")
        broker.join(charge_order.queue_name)
        worker.join()
    finally:
        worker.stop()
    o1 = sorted(o.value for order, o in outcomes if order == "o-1")
    assert o1 == ["duplicate", "processed"]
    assert [o for order, o in outcomes if order == "o-2"] == [Outcome.RETRY, Outcome.PROCESSED]
    with pg.engine.connect() as conn:
        rows = conn.execute(text(f"SELECT account, amount FROM {ledger} ORDER BY 1"))
        assert [tuple(r) for r in rows] == [("o-1", 5), ("o-2", 7)]
        recorded = conn.execute(text(f"SELECT count(*) FROM {pg.name('processed_events')}"))
        assert recorded.scalar() == 2
