"""The Kafka runner passes the shared runner contract, on a real Kafka-protocol broker."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import pytest

from consumerdedup import Result, SimulatedCrash
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.headers import ID_HEADER, REASON_HEADER
from tests.contracts.runner import Capabilities, RunnerContract, ledger_handler
from tests.support.flavors import Behavior
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture  # noqa: F401

T = TypeVar("T")


def crash(results: Sequence[Result]) -> None:
    raise SimulatedCrash("killed between the database commit and the offset commit")


class KafkaHarness:
    """One single-partition topic and one consumer group per test.

    The suite is synchronous; the runners, the AsyncEngine and the broker
    clients live on the harness's own event loop, in a thread. The runner is
    configured with ``coordinates_as_id=False``: the contract's "message
    without a usable id" is a record without an ``event_id`` header, which by
    default would take its ``topic:partition:offset`` as id.
    """

    # A RETRY holds back its partition: the records behind it are read again after it.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=True)

    def __init__(self, db: Any, kafka: KafkaService) -> None:
        self.db = db
        self.kafka = kafka
        self.told: list[Result] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine = db.async_engine()
        self.topics = Topics(kafka)
        self.topic = self._call(self.topics.create("conformance"))
        self.group = f"ledger-{uuid.uuid4().hex[:8]}"

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def publish(self, message_id: str | None, body: bytes) -> None:
        self._call(self.topics.produce(self.topic, body, event_id=message_id))

    def _runner(
        self,
        behavior: Behavior,
        batch_size: int,
        before_ack: Any = None,
        asyncio: bool | None = None,
    ) -> KafkaConsumerRunner:
        kind = True if asyncio is None else asyncio
        handle = ledger_handler(
            self.db, behavior, self.told, asyncio=kind, async_engine=self.engine
        )
        config = self.kafka.config(
            batch_size=batch_size,
            poll_timeout=timedelta(milliseconds=100),
            retry_delay=timedelta(0),
            coordinates_as_id=False,
        )
        return KafkaConsumerRunner(
            handle,
            self.topic,
            bootstrap_servers=self.kafka.bootstrap,
            group_id=self.group,
            config=config,
            before_ack=before_ack,
        )

    def consume(
        self,
        behavior: Behavior,
        *,
        batch_size: int = 1,
        crash_after_commit: bool = False,
        asyncio: bool | None = None,
    ) -> None:
        crashing = crash if crash_after_commit else None
        runner = self._runner(behavior, batch_size, crashing, asyncio)
        self._call(runner.run(until_idle=True))

    def start(self, behavior: Behavior, *, batch_size: int = 1) -> Callable[[], None]:
        runner = self._runner(behavior, batch_size)
        running = asyncio.run_coroutine_threadsafe(runner.run(), self.loop)

        def stop() -> None:
            runner.stop()
            running.result(30)

        return stop

    def held(self) -> int:
        return self._call(self.topics.lag(self.group, self.topic))

    def dead_letters(self) -> list[tuple[str | None, str]]:
        found = []
        for record in self._call(self.topics.records(self.topic + ".dlq")):
            headers = dict(record.headers)
            message_id = headers.get(ID_HEADER)
            found.append(
                (
                    None if message_id is None else message_id.decode(),
                    headers[REASON_HEADER].decode(),
                )
            )
        return found

    def close(self) -> None:
        try:
            self._call(self.topics.close())
            self._call(self.engine.dispose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


class TestKafka(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any, kafka: KafkaService) -> Iterator[KafkaHarness]:
        harness = KafkaHarness(db, kafka)
        yield harness
        harness.close()
