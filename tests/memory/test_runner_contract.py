"""The MemoryBroker runner passes the shared runner contract."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from consumerdedup import Result, SimulatedCrash
from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner
from consumerdedup.testing.memory_broker import REASON_HEADER
from tests.contracts.runner import Capabilities, RunnerContract, ledger_handler
from tests.support.flavors import Behavior


def crash(results: Sequence[Result]) -> None:
    raise SimulatedCrash("died between commit and ack")


class MemoryHarness:
    # A RETRY is given back to the front, but its batch-mates were acked before it.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=False)
    source = "payments"

    def __init__(self, db: Any) -> None:
        self.db = db
        self.broker = MemoryBroker()
        self.told: list[Result] = []

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.broker.publish(self.source, body, message_id=message_id)

    def _runner(
        self,
        behavior: Behavior,
        batch_size: int,
        crash_after_commit: bool = False,
        asyncio: bool | None = None,
    ) -> MemoryConsumerRunner:
        handle = ledger_handler(self.db, behavior, self.told, asyncio=bool(asyncio))
        return MemoryConsumerRunner(
            self.broker,
            self.source,
            handle,
            batch_size=batch_size,
            retry_delay=0.0,
            before_ack=crash if crash_after_commit else None,
        )

    def consume(
        self,
        behavior: Behavior,
        *,
        batch_size: int = 1,
        crash_after_commit: bool = False,
        asyncio: bool | None = None,
    ) -> None:
        # The runner itself dies, as the adapters' do: the broker must notice.
        self._runner(behavior, batch_size, crash_after_commit, asyncio).run(until_idle=True)

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
