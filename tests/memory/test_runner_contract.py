"""The MemoryBroker runner passes the shared runner contract."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest

from consumerdedup.lifecycle import BeforeAck
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from consumerdedup.testing.memory_broker import REASON_HEADER
from tests.contracts.harness import Capabilities, RunnerHarness
from tests.contracts.runner import RunnerContract
from tests.support.async_drivers import async_url

QUEUE = "payments"


class MemoryHarness(RunnerHarness):
    # A RETRY is given back to the front, but its batch-mates were acked before it.
    capabilities = Capabilities(ordered=True, batches=True, retry_keeps_order=False)

    def __init__(self, db: Any) -> None:
        super().__init__(db)
        self.broker = MemoryBroker()

    def publish(self, message_id: str | None, body: bytes) -> None:
        self.broker.publish(QUEUE, body, message_id=message_id)

    def runner(
        self, handler: Any, *, batch_size: int, before_ack: BeforeAck | None
    ) -> MemoryConsumerRunner:
        config = MemoryConfig(
            batch_size=batch_size, poll_timeout=timedelta(milliseconds=50), retry_delay=timedelta(0)
        )
        return MemoryConsumerRunner(
            handler, QUEUE, broker=self.broker, config=config, before_ack=before_ack
        )

    def held(self) -> int:
        return self.broker.held(QUEUE)

    def dead_letters(self) -> list[tuple[str | None, str]]:
        return [(m.id, m.headers[REASON_HEADER]) for m in self.broker.messages(QUEUE + ".dlq")]


class TestMemoryBroker(RunnerContract):
    @pytest.fixture
    def harness(self, db: Any) -> MemoryHarness:
        return MemoryHarness(db)


class AsyncpgHarness(MemoryHarness):
    """The same broker, its handlers AsyncDeduplicator's on asyncpg (issue 34)."""

    asyncio_by_default = True


class TestMemoryBrokerOnAsyncpg(RunnerContract):
    """The runner contract with AsyncDeduplicator on postgresql+asyncpg, whose aborted state
    the guard asks the server (consumerdedup.dedup.asyncpg_watch)."""

    @pytest.fixture
    def harness(self, pg: Any) -> MemoryHarness:
        return AsyncpgHarness(replace(pg, async_url=async_url(pg.url, "asyncpg")))


class TestMemoryBrokerOnMariaDB(RunnerContract):
    """The runner contract on MariaDB (InnoDB) through PyMySQL (issue 34)."""

    @pytest.fixture
    def harness(self, mariadb: Any) -> MemoryHarness:
        return MemoryHarness(mariadb)


class AiomysqlHarness(MemoryHarness):
    """The same broker, its handlers AsyncDeduplicator's on aiomysql."""

    asyncio_by_default = True


class TestMemoryBrokerOnMariaDBAsync(RunnerContract):
    """The runner contract with AsyncDeduplicator on MariaDB through aiomysql (issue 34)."""

    @pytest.fixture
    def harness(self, mariadb: Any) -> MemoryHarness:
        return AiomysqlHarness(mariadb)
