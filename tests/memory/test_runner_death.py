"""A MemoryConsumerRunner that dies gives back what it held, as a real broker's consumer does.

The runner conformance suite (tests/contracts/runner.py) kills runners with
SimulatedCrash; here the handler is interrupted the way a user stops a
process, with KeyboardInterrupt.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database


def test_keyboard_interrupt_in_a_handler_leaves_every_delivery_to_the_next_runner(
    sqlite_db: Database,
) -> None:
    ledger = sqlite_db.create_ledger()
    broker = MemoryBroker()
    for n in range(4):
        broker.publish("payments", b"{}", message_id=f"p{n}")
    interrupted: list[str] = []
    dedup = Deduplicator(sqlite_db.engine, "ledger", tables=sqlite_db.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        if message.id == "p1" and not interrupted:
            interrupted.append(message.id)
            raise KeyboardInterrupt
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    config = MemoryConfig(batch_size=3)
    with pytest.raises(KeyboardInterrupt):
        MemoryConsumerRunner(handle, "payments", broker=broker, config=config).run(until_idle=True)
    assert broker.held("payments") == 4  # the batch in flight rolled back; none acked

    MemoryConsumerRunner(handle, "payments", broker=broker, config=config).run(until_idle=True)
    with sqlite_db.engine.connect() as conn:
        applied = sorted(r[0] for r in conn.exec_driver_sql(f"SELECT message_id FROM {ledger}"))
    assert applied == ["p0", "p1", "p2", "p3"]
    assert broker.held("payments") == 0
