"""Our declaration and our pruner agree (issue 38, item 12): a queue that
``RabbitConfig(declare=True, message_ttl=...)`` declared is one ``prune --rabbitmq`` reads
its window from; one declared without a TTL is refused with a line naming the setting."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from consumerdedup import ConfigurationError, Deduplicator, Message
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.cli.test_prune import ages, fill, prune
from tests.conftest import Database
from tests.support import services
from tests.support.rabbitmq_service import (  # noqa: F401
    RABBITMQCTL_NEEDED,
    Broker,
    amqp_url_fixture,
    rabbit_fixture,
)


def declare(db: Database, rabbit: Broker, config: RabbitConfig, queue: str) -> None:
    """``queue`` (and its DLQ) declared by the runner, as a deploy script does."""
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:  # never called: nothing is consumed
        raise AssertionError(message)

    RabbitConsumerRunner(handle, queue, url=rabbit.url, config=config).declare()


def test_a_queue_declared_with_a_message_ttl_sets_the_window(
    sqlite_db: Database, rabbit: Broker
) -> None:
    services.tool("rabbitmqctl", RABBITMQCTL_NEEDED)
    fill(sqlite_db)
    config = RabbitConfig(declare=True, message_ttl=timedelta(days=2))
    queue = rabbit.name("declared")
    declare(sqlite_db, rabbit, config, queue)
    run = prune(sqlite_db, "--rabbitmq", rabbit.url, "--queues", queue, "--consumer", "ledger")
    assert run.code == 0, run.err
    assert f"{queue}: 2d (x-message-ttl=172800000)" in run.out
    assert ages(sqlite_db, "ledger") == set(range(3))  # 2 days + the 1-day buffer
    assert ages(sqlite_db, "mail") == set(range(30))  # not a consumer of that queue
    declare(sqlite_db, rabbit, config, queue)  # again, as every start does: the same arguments


def test_a_queue_declared_without_a_ttl_names_the_setting(
    sqlite_db: Database, rabbit: Broker
) -> None:
    services.tool("rabbitmqctl", RABBITMQCTL_NEEDED)
    fill(sqlite_db)
    queue = rabbit.name("declared")
    declare(sqlite_db, rabbit, RabbitConfig(declare=True), queue)
    run = prune(sqlite_db, "--rabbitmq", rabbit.url, "--queues", queue, "--consumer", "ledger")
    run.assert_usage_error("RabbitConfig(message_ttl=", "--retention DURATION")
    assert ages(sqlite_db, "ledger") == set(range(30))


@pytest.mark.parametrize(
    "options",
    [
        {"message_ttl": timedelta(milliseconds=10)},
        {"message_ttl": 3600},
        {"message_ttl": timedelta(days=3650, milliseconds=1)},
        {"message_ttl": timedelta(days=1), "queue_arguments": {"x-message-ttl": 1000}},
    ],
)
def test_a_message_ttl_that_cannot_be_one_is_refused(options: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError, match="message_ttl"):
        RabbitConfig(declare=True, **options)  # type: ignore[arg-type]
