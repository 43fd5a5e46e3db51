"""examples/payments_service run unchanged on MariaDB (issue 34's "done when"): only its
``CONSUMERDEDUP_DATABASE_URL`` is a ``mysql+pymysql://`` one. ``python -m
payments_service.schema`` makes its database (a MySQL schema) and tables, ``consumerdedup
run --workers 2`` consumes RabbitMQ payments and Kafka order lines and relays the outbox
(SKIP LOCKED, key-lock rows) to Kafka; a child SIGKILLed mid-stream is restarted, and
every message is decided exactly once: nothing lost, nothing doubled."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import metric, wait_for
from tests.worker.test_payments_service import (
    ORDERS,
    PAYMENTS,
    Service,
    outcomes,
    publish_stream,
    ready,
)


class MySQLService(Service):
    """The service on MariaDB: its schema is a database of its own, dropped after."""

    def close(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS `{self.schema}`"))
        self.engine.dispose()


@pytest.fixture
async def service(
    mariadb_url: str, amqp_url: str, kafka: KafkaService, topics: Topics, rabbit: Broker
) -> Iterator[Service]:
    names = {
        "PAYMENTS_QUEUE": rabbit.queue("pay"),
        "PAYMENTS_ORDERS_TOPIC": await topics.create("orders", partitions=4),
        "PAYMENTS_EVENTS_TOPIC": await topics.create("events", partitions=2),
    }
    assert mariadb_url.startswith("mysql+pymysql://")
    made = MySQLService(mariadb_url, amqp_url, kafka, names)
    yield made
    made.close()


async def test_the_payments_service_on_mariadb_decides_each_message_once_through_a_kill(
    service: Service, rabbit: Broker, topics: Topics
) -> None:
    args = ("--workers", "2", "--health-port", "0", "--log-format", "json", "--log-level", "DEBUG")
    run = service.start(*args)
    try:
        ready(run)
        await publish_stream(service, rabbit, topics)
        wait_for(lambda: service.decided("payments") >= PAYMENTS // 5, 120, "a fifth decided")
        victim = run.child_pids()[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: victim not in run.child_pids() and len(run.child_pids()) == 2, 60, "restart"
        )
        wait_for(lambda: run.status("/readyz") == 200, 120, "ready again")
        wait_for(lambda: service.decided("payments") == PAYMENTS, 180, "all payments")
        wait_for(lambda: service.decided("orders") == ORDERS, 180, "all orders")
        wait_for(lambda: rabbit.ready(service.env["PAYMENTS_QUEUE"]) == 0, 60, "queue drained")
        unpublished = "SELECT count(*) FROM {s}.outbox WHERE published_at IS NULL"
        wait_for(lambda: service.scalar(unpublished) == 0, 60, "outbox relayed")
        _, metrics = run.get("/metrics")
        assert metric(metrics, "consumerdedup_worker_restarts_total") == 1
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr[-3000:]
    finally:
        run.stop()
    # No unique key on the business tables: a message applied twice would show here.
    assert service.rows("payments", "payment_id") == (PAYMENTS, PAYMENTS)
    assert service.rows("order_lines", "order_id") == (ORDERS, ORDERS)
    seen = outcomes(run.stderr)
    assert seen[("payments", "failed")] == seen[("orders", "failed")] == 0
    # The copies published again were each answered DUPLICATE by one worker or the other.
    assert seen[("payments", "duplicate")] >= 1 and seen[("orders", "duplicate")] >= 1
    assert rabbit.held(service.env["PAYMENTS_QUEUE"]) == 0
    assert await topics.lag(service.group, service.env["PAYMENTS_ORDERS_TOPIC"]) == 0
    events = await topics.records(service.env["PAYMENTS_EVENTS_TOPIC"])
    assert len({dict(r.headers)["event_id"] for r in events}) == PAYMENTS  # relayed, at least once
