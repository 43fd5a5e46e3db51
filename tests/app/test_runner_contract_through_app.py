"""The runner contract, every runner started through an App: the App adds no runtime of its
own, so each broker's scenarios must hold the same when its part runs them."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import App, AsyncBulkDedupHandler, BulkDedupHandler
from consumerdedup.app import Part, Settings
from consumerdedup.lifecycle import BeforeAck
from tests.contracts.runner import RunnerContract
from tests.kafka.test_runner_contract import KafkaHarness
from tests.memory.test_runner_contract import QUEUE, MemoryHarness
from tests.rabbitmq.test_runner_contract import RabbitHarness
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


class PartRunner:
    """A part as the harness drives a runner."""

    def __init__(self, part: Part) -> None:
        self.part = part

    def run(self, *, until_idle: bool = False) -> None:
        self.part.run(until_idle=until_idle)  # type: ignore[attr-defined]

    def stop(self, deadline: float | None = None) -> None:
        self.part.stop(deadline)

    @property
    def ready(self) -> bool:
        return self.part.ready

    @property
    def last_tick(self) -> float:
        return self.part.last_tick


class AsyncPartRunner(PartRunner):
    """A Kafka part on the harness's event loop (its handler's engine is bound to it)."""

    async def run(self, *, until_idle: bool = False) -> None:  # type: ignore[override]
        await self.part.run_async(until_idle=until_idle)  # type: ignore[attr-defined]


def one_part(app: App, settings: Settings, **build: Any) -> Part:
    [part] = app.build(settings, **build)
    return part


def declared(app: App, handler: Any, before_ack: BeforeAck | None, **source: Any) -> None:
    bulk = isinstance(handler, BulkDedupHandler | AsyncBulkDedupHandler)
    decorate = app.kafka if "topics" in source else app.rabbitmq
    decorate(consumer=handler.dedup.consumer, bulk=bulk, before_ack=before_ack, **source)(handler)


class MemoryThroughApp(MemoryHarness):
    def runner(self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None) -> Any:
        app = App("contract")
        declared(
            app, handler, before_ack, queue=QUEUE, batch_size=batch_size, retry_delay=timedelta(0)
        )
        return PartRunner(one_part(app, Settings.load(), memory_broker=self.broker))


class RabbitThroughApp(RabbitHarness):
    def runner(self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None) -> Any:
        plain = super().runner(handler, batch_size=batch_size, before_ack=before_ack)
        app = App("contract")
        declared(app, handler, before_ack, queue=self.queue, config=plain.config)
        return PartRunner(one_part(app, Settings.load(rabbitmq_url=self.broker.url)))


class KafkaThroughApp(KafkaHarness):
    def runner(self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None) -> Any:
        plain = super().runner(handler, batch_size=batch_size, before_ack=before_ack)
        app = App("contract")
        declared(
            app, handler, before_ack, topics=[self.topic], config=plain.config, group_id=self.group
        )
        settings = Settings.load(kafka_bootstrap_servers=self.kafka.bootstrap)
        return AsyncPartRunner(one_part(app, settings))


class TestMemoryThroughApp(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any) -> MemoryThroughApp:
        return MemoryThroughApp(db)


class TestRabbitMQThroughApp(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any, rabbit: Broker) -> Iterator[RabbitThroughApp]:
        with RabbitThroughApp(db, rabbit) as harness:
            yield harness


class TestKafkaThroughApp(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any, kafka: KafkaService) -> Iterator[KafkaThroughApp]:
        with KafkaThroughApp(db, kafka) as harness:
            yield harness
