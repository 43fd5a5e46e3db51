"""The MemoryBroker runner passes the shared runner contract."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, Result, RetryPolicy, SimulatedCrash
from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner
from consumerdedup.testing.memory_broker import REASON_HEADER
from tests.contracts.runner import Capabilities, RunnerContract
from tests.support.flavors import Behavior

QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def crash(results: Sequence[Result]) -> None:
    raise SimulatedCrash("died between commit and ack")


class MemoryHarness:
    capabilities = Capabilities(ordered=True, batches=True)
    source = "payments"

    def __init__(self, db: Any) -> None:
        self.db = db
        self.broker = MemoryBroker()

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.broker.publish(self.source, body, message_id=message_id)

    def _runner(
        self, behavior: Behavior, batch_size: int, crash_after_commit: bool = False
    ) -> MemoryConsumerRunner:
        dedup = Deduplicator(
            self.db.engine, consumer="ledger", tables=self.db.tables, retry=QUICK_RETRY
        )

        @dedup.handler
        def handle(message: Message, session: Any) -> None:
            for sql, params in behavior(message):
                session.execute(text(sql), params)

        return MemoryConsumerRunner(
            self.broker,
            self.source,
            handle,
            batch_size=batch_size,
            retry_delay=0.0,
            before_ack=crash if crash_after_commit else None,
        )

    def consume(
        self, behavior: Behavior, *, batch_size: int = 1, crash_after_commit: bool = False
    ) -> None:
        # The runner itself dies, as the adapters' do: the broker must notice.
        self._runner(behavior, batch_size, crash_after_commit).run(until_idle=True)

    def start(self, behavior: Behavior, *, batch_size: int = 1) -> Callable[[], None]:
        runner = self._runner(behavior, batch_size)
        thread = threading.Thread(target=runner.run, daemon=True)
        thread.start()

        def stop() -> None:
            runner.stop()
            thread.join(30)
            assert not thread.is_alive()

        return stop

    def held(self) -> int:
        return self.broker.held(self.source)

    def dead_letters(self) -> list[tuple[str | None, str]]:
        return [
            (m.id, m.headers[REASON_HEADER]) for m in self.broker.messages(self.source + ".dlq")
        ]


class TestMemoryBroker(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any) -> MemoryHarness:
        return MemoryHarness(db)
