"""A window read from a broker belongs to the consumers of those topics or queues: the Pruner
API applies it to the consumers named and refuses it unscoped (real Tansu and RabbitMQ)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from consumerdedup import ConfigurationError, Pruner
from consumerdedup.adapters.kafka.retention import kafka_retention
from consumerdedup.adapters.rabbitmq.retention import rabbitmq_retention
from consumerdedup.prune.windows import BrokerRetention
from tests.cli.test_prune import ages, fill, make_topic, rabbit_queues
from tests.conftest import Database
from tests.support import services
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import RABBITMQCTL_NEEDED, amqp_url_fixture  # noqa: F401


@pytest.fixture
def kafka_window(kafka: KafkaService) -> BrokerRetention:
    """5 days + 1 day of segment, read from a real topic."""
    topic = make_topic(kafka, **{"retention.ms": str(5 * 86_400_000), "segment.ms": "86400000"})
    return kafka_retention(kafka.bootstrap, [topic])


@pytest.fixture
def rabbitmq_window(amqp_url: str) -> Any:
    """2 days: a queue's x-message-ttl, read with rabbitmqctl."""
    services.tool("rabbitmqctl", RABBITMQCTL_NEEDED)
    with rabbit_queues(amqp_url) as (with_ttl, _):
        yield rabbitmq_retention(amqp_url, [with_ttl])


@pytest.mark.parametrize(("window", "kept"), [("kafka_window", 7), ("rabbitmq_window", 3)])
def test_a_broker_window_prunes_only_the_consumers_named(
    sqlite_db: Database, request: pytest.FixtureRequest, window: str, kept: int
) -> None:
    fill(sqlite_db)
    found = request.getfixturevalue(window)
    Pruner(sqlite_db.engine, found, consumers=["ledger"], tables=sqlite_db.tables).prune()
    assert ages(sqlite_db, "ledger") == set(range(kept))  # the window + the 1-day buffer
    assert ages(sqlite_db, "mail") == set(range(30))  # mail reads something else


@pytest.mark.parametrize("window", ["kafka_window", "rabbitmq_window"])
def test_an_unscoped_broker_window_is_refused(
    sqlite_db: Database, request: pytest.FixtureRequest, window: str
) -> None:
    fill(sqlite_db)
    found = request.getfixturevalue(window)
    with pytest.raises(ConfigurationError, match=r"name them with consumers=\[\.\.\.\]"):
        Pruner(sqlite_db.engine, found, tables=sqlite_db.tables)
    with pytest.raises(ConfigurationError, match="consumers="):
        Pruner(
            sqlite_db.engine, found, windows={"mail": timedelta(days=30)}, tables=sqlite_db.tables
        )
    assert ages(sqlite_db, "mail") == set(range(30))


def test_a_broker_window_can_be_one_consumers_own(
    sqlite_db: Database, kafka_window: BrokerRetention
) -> None:
    fill(sqlite_db)
    windows = {"ledger": kafka_window}
    report = Pruner(
        sqlite_db.engine, timedelta(days=20), windows=windows, tables=sqlite_db.tables
    ).run_once()
    assert ages(sqlite_db, "ledger") == set(range(7))
    assert ages(sqlite_db, "mail") == set(range(22))
    assert report.cutoffs["ledger"] is not None
    assert report.cutoffs["ledger"] < datetime.now(UTC) - timedelta(days=7)
