"""The Kafka runner passes the shared runner contract, on a real Kafka-protocol broker, with
its offsets committed to the broker (the default) and kept in the database
(``KafkaConfig(offsets="database")``, issue 36)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.headers import ID_HEADER, REASON_HEADER
from consumerdedup.lifecycle import BeforeAck
from tests.contracts.harness import Capabilities, RunnerHarness
from tests.contracts.runner import RunnerContract
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture  # noqa: F401


class KafkaHarness(RunnerHarness):
    """One single-partition topic and one consumer group per test.

    The runner, the AsyncEngine and the broker clients live on the harness's event
    loop. The runner is configured with ``coordinates_as_id=False``: the contract's
    "message without a usable id" is a record without an ``event_id`` header, which
    by default would take its ``topic:partition:offset`` as id.
    """

    # A RETRY holds back its partition: the records behind it are read again after it.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=True)
    asyncio_by_default = True

    def __init__(self, db: Any, kafka: KafkaService, offsets: str = "broker") -> None:
        super().__init__(db)
        self.kafka = kafka
        self.offsets = offsets
        self.async_engine = db.async_engine()
        self.topics = Topics(kafka)
        self.topic = self.call(self.topics.create("conformance"))
        self.group = f"ledger-{uuid.uuid4().hex[:8]}"

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.call(self.topics.produce(self.topic, body, event_id=message_id))

    def runner(
        self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None
    ) -> KafkaConsumerRunner:
        config = self.kafka.config(
            batch_size=batch_size,
            poll_timeout=timedelta(milliseconds=100),
            retry_delay=timedelta(0),
            coordinates_as_id=False,
            offsets=self.offsets,
        )
        return KafkaConsumerRunner(
            handler,
            self.topic,
            bootstrap_servers=self.kafka.bootstrap,
            group_id=self.group,
            config=config,
            before_ack=before_ack,
        )

    def held(self) -> int:
        return self.call(self.topics.lag(self.group, self.topic))

    def dead_letters(self) -> list[tuple[str | None, str]]:
        found = []
        for record in self.call(self.topics.records(self.topic + ".dlq")):
            headers = dict(record.headers)
            message_id = headers.get(ID_HEADER)
            reason = headers[REASON_HEADER].decode()
            found.append((None if message_id is None else message_id.decode(), reason))
        return found

    def close(self) -> None:
        try:
            self.call(self.topics.close())
            if self.async_engine is not None:
                self.call(self.async_engine.dispose())
        finally:
            super().close()


class TestKafka(RunnerContract):
    @pytest.fixture(params=["broker", "database"])
    def harness(
        self, request: pytest.FixtureRequest, db: Any, kafka: KafkaService
    ) -> Iterator[KafkaHarness]:
        with KafkaHarness(db, kafka, offsets=request.param) as harness:
            yield harness
