"""RabbitConsumerRunner passes the shared runner contract against the real broker."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import Result, SimulatedCrash
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.headers import REASON_HEADER
from tests.contracts.runner import Capabilities, RunnerContract, ledger_handler
from tests.support.flavors import Behavior
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def crash(results: Sequence[Result]) -> None:
    raise SimulatedCrash("died between commit and ack")


class RabbitHarness:
    # One consumer on one queue sees publish order; a RETRY requeued behind what was
    # prefetched is overtaken.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=False)

    def __init__(self, db: Any, broker: Broker) -> None:
        self.db = db
        self.broker = broker
        self.told: list[Result] = []
        self.queue = broker.queue("contract")

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.broker.publish(self.queue, body, message_id=message_id)

    def _runner(
        self,
        behavior: Behavior,
        batch_size: int,
        crash_after_commit: bool = False,
        asyncio: bool | None = None,
    ) -> RabbitConsumerRunner:
        handle = ledger_handler(self.db, behavior, self.told, asyncio=bool(asyncio))
        config = RabbitConfig(
            prefetch=max(10, batch_size),
            batch_size=batch_size,
            declare=True,
            retry_delay=timedelta(0),
            idle_timeout=timedelta(milliseconds=300),
        )
        return RabbitConsumerRunner(
            handle,
            self.queue,
            url=self.broker.url,
            config=config,
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
        return self.broker.held(self.queue)

    def dead_letters(self) -> list[tuple[str | None, str]]:
        return [
            (props.message_id, props.headers[REASON_HEADER])
            for props, _ in self.broker.peek(self.queue + ".dlq")
        ]


class TestRabbitMQ(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any, rabbit: Broker) -> Iterator[RabbitHarness]:
        yield RabbitHarness(db, rabbit)
