"""RabbitConsumerRunner passes the shared runner contract against the real broker."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.headers import REASON_HEADER
from consumerdedup.lifecycle import BeforeAck
from tests.contracts.harness import Capabilities, RunnerHarness
from tests.contracts.runner import RunnerContract
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


class RabbitHarness(RunnerHarness):
    # One consumer on one queue sees publish order; a RETRY requeued behind what was
    # prefetched is overtaken.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=False)

    def __init__(self, db: Any, broker: Broker) -> None:
        super().__init__(db)
        self.broker = broker
        self.queue = broker.queue("contract")

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.broker.publish(self.queue, body, message_id=message_id)

    def runner(
        self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None
    ) -> RabbitConsumerRunner:
        config = RabbitConfig(
            prefetch=max(10, batch_size),
            batch_size=batch_size,
            declare=True,
            retry_delay=timedelta(0),
            idle_timeout=timedelta(milliseconds=300),
        )
        return RabbitConsumerRunner(
            handler, self.queue, url=self.broker.url, config=config, before_ack=before_ack
        )

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
        with RabbitHarness(db, rabbit) as harness:
            yield harness
