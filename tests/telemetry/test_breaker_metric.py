"""The circuit breaker's metrics (issue 38 item 6): a consumer whose breaker opened is 1 on
``consumerdedup.consumer.breaker.open`` with the error type, and counted once on
``consumerdedup.consumer.breaker.trips``; reset, it is 0 again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import CircuitOpen, Deduplicator, Message, RetryPolicy
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.conftest import Database
from tests.telemetry.conftest import Otel


def test_an_open_breaker_is_a_metric_by_consumer_and_error_type(
    sqlite_db: Database, otel: Otel
) -> None:
    zero = timedelta(0)
    retry = RetryPolicy(attempts=1, initial_delay=zero, max_delay=zero, breaker_threshold=2)
    dedup = Deduplicator(sqlite_db.engine, "shop", tables=sqlite_db.tables, retry=retry)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        raise KeyError("sku")

    broker = MemoryBroker()
    for n in range(5):
        broker.publish("orders", b"{}", message_id=f"o{n}")
    config = MemoryConfig(retry_delay=zero, max_retry_delay=zero)
    runner = MemoryConsumerRunner(handle, "orders", broker=broker, config=config)
    with pytest.raises(CircuitOpen):
        runner.run(until_idle=True)
    (opened,) = otel.points("consumerdedup.consumer.breaker.open")
    assert opened.value == 1
    assert dict(opened.attributes) == {
        "consumerdedup.consumer": "shop",
        "error.type": "KeyError",
    }
    (trips,) = otel.points("consumerdedup.consumer.breaker.trips")
    assert trips.value == 1
    runner.breaker.reset()
    (opened,) = otel.points("consumerdedup.consumer.breaker.open")
    assert opened.value == 0
