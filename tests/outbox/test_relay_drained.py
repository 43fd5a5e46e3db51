"""``await relay.drained()``: the asyncio form of ``wait_drained``, for a relay run in a thread.

The README: "with relay.run() in a thread, relay.wait_drained(timeout) (or await
relay.drained()) blocks until the backlog is empty". It must return True once every
committed row is published, False when the backlog cannot empty within the timeout, and
leave the event loop free while it waits.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta

import pytest
from sqlalchemy.orm import Session

from consumerdedup import BrokerUnavailable, Outbox, OutboxRelay, RelayConfig
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

CONFIG = RelayConfig(
    poll_interval=timedelta(milliseconds=50),
    initial_backoff=timedelta(milliseconds=50),
    max_backoff=timedelta(milliseconds=50),
)


class Away(MemoryBroker):
    """A broker that is away until ``back`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.back = threading.Event()

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        *,
        message_id: str | None = None,
    ) -> None:
        if not self.back.is_set():
            raise BrokerUnavailable("the broker is away")
        super().publish(destination, body, key, headers, message_id=message_id)


def add(db: Database, count: int) -> None:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        for n in range(count):
            outbox.add(session, "orders", f"e{n}".encode(), key=f"k{n % 3}")


@pytest.fixture
def running(db: Database) -> Iterator[tuple[OutboxRelay, Away]]:
    broker = Away()
    relay = OutboxRelay(db.engine, broker, tables=db.tables, config=CONFIG)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    yield relay, broker
    relay.stop()
    thread.join(20)
    assert not thread.is_alive()


async def ticking(until: asyncio.Event) -> int:
    """How many times the loop ran this coroutine while something else awaited."""
    ticks = 0
    while not until.is_set():
        ticks += 1
        await asyncio.sleep(0.01)
    return ticks


async def test_drained_is_false_while_the_backlog_cannot_empty_then_true(
    db: Database, running: tuple[OutboxRelay, Away]
) -> None:
    relay, broker = running
    add(db, 20)
    done = asyncio.Event()
    ticker = asyncio.create_task(ticking(done))
    started = time.monotonic()
    assert await relay.drained(0.5) is False  # the broker is away: nothing can go
    waited = time.monotonic() - started
    done.set()
    assert 0.5 <= waited < 10
    assert await ticker >= 10  # the loop went on while drained() waited
    assert broker.messages("orders") == []

    broker.back.set()
    assert await relay.drained(30) is True
    assert sorted(m.body for m in broker.messages("orders")) == sorted(
        f"e{n}".encode() for n in range(20)
    )
    assert relay.backlog() == 0


async def test_drained_waits_for_rows_committed_meanwhile(
    db: Database, running: tuple[OutboxRelay, Away]
) -> None:
    relay, broker = running
    broker.back.set()
    assert await relay.drained(10) is True  # nothing to do
    for _ in range(3):
        await asyncio.to_thread(add, db, 10)
        assert await relay.drained(30) is True
        assert relay.backlog() == 0
    assert len(broker.messages("orders")) == 30
