"""examples/payments_service run as shipped with ``consumerdedup run --workers 2`` against
the real PostgreSQL, RabbitMQ and Kafka-protocol broker: a RabbitMQ consumer, a Kafka bulk
consumer and the relay. Stopped mid-stream by SIGTERM, a child SIGKILLed: every message
decided exactly once, nothing lost, nothing doubled, nothing committed left unacked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text

from tests.support.kafka_joins import wedge
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import ROOT, Run, metric, wait_for

EXAMPLES = ROOT / "examples"
APP = "payments_service:app"
PAYMENTS, ORDERS, COPIES = 1500, 600, 100


class Service:
    """The service's names, environment and database, unique to one test."""

    def __init__(
        self, postgres_url: str, amqp_url: str, kafka: KafkaService, names: dict[str, str]
    ):
        self.schema = f"pay_{uuid.uuid4().hex[:10]}"
        self.group = f"orders-{self.schema}"
        """The orders part's Kafka group, this test's own: every test of a process shares one
        broker, and Tansu 0.6 can leave a group wedged for the next test that joins it."""
        self.url = postgres_url
        self.env = {
            "CONSUMERDEDUP_DATABASE_URL": postgres_url,
            "CONSUMERDEDUP_RABBITMQ_URL": amqp_url,
            "CONSUMERDEDUP_KAFKA_BOOTSTRAP_SERVERS": kafka.bootstrap,
            "PAYMENTS_SCHEMA": self.schema,
            "PAYMENTS_ORDERS_GROUP": self.group,
            "PAYMENTS_KAFKA_IDEMPOTENCE": "1" if kafka.idempotence else "0",
            "PAYMENTS_KAFKA_SESSION_TIMEOUT_MS": str(
                kafka.group_options.get("session_timeout_ms", 10000)
            ),
            "PAYMENTS_KAFKA_HEARTBEAT_MS": str(
                kafka.group_options.get("heartbeat_interval_ms", 3000)
            ),
            **names,
        }
        subprocess.run([sys.executable, "-m", "payments_service.schema"], cwd=EXAMPLES,
                       env={**os.environ, **self.env}, check=True, capture_output=True)  # fmt: skip
        self.engine = create_engine(postgres_url)

    def start(self, *args: str, **env: str) -> Run:
        return Run([APP, *args], {**self.env, **env}, cwd=EXAMPLES)

    def scalar(self, sql: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql.format(s=self.schema))).scalar() or 0)

    def rows(self, table: str, key: str) -> tuple[int, int]:
        """(rows, distinct keys) of a business table: a double shows as rows > distinct."""
        with self.engine.connect() as conn:
            sql = f"SELECT count(*), count(DISTINCT {key}) FROM {self.schema}.{table}"
            rows, distinct = conn.execute(text(sql)).one()
            return int(rows), int(distinct)

    def decided(self, consumer: str) -> int:
        return self.scalar(
            f"SELECT count(*) FROM {{s}}.processed_events WHERE consumer = '{consumer}'"
        )

    def blocked(self) -> int:
        """Sessions of the service waiting for a lock (its batches blocked in flight)."""
        return self.scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query ILIKE '%{s}.payments%'"
        )

    def close(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))
        self.engine.dispose()


@pytest.fixture
async def service(
    postgres_url: str, amqp_url: str, kafka: KafkaService, topics: Topics, rabbit: Broker
) -> Iterator[Service]:
    names = {
        "PAYMENTS_QUEUE": rabbit.queue("pay"),
        "PAYMENTS_ORDERS_TOPIC": await topics.create("orders", partitions=4),
        "PAYMENTS_EVENTS_TOPIC": await topics.create("events", partitions=2),
    }
    made = Service(postgres_url, amqp_url, kafka, names)
    yield made
    made.close()


def payment(i: int) -> tuple[str, bytes]:
    pid = f"pay-{i:05d}"
    body = {"payment_id": pid, "account": f"acct-{i % 7}", "amount": f"{i % 90 + 1}.50",
            "currency": "EUR"}  # fmt: skip
    return pid, json.dumps(body).encode()


def order(i: int) -> tuple[str, bytes]:
    oid = f"ord-{i:05d}"
    return oid, json.dumps(
        {"order_id": oid, "sku": f"sku-{i % 13}", "quantity": 1 + i % 4}
    ).encode()


async def publish_stream(
    service: Service, rabbit: Broker, topics: Topics, payments: range = range(PAYMENTS)
) -> None:
    """These payments, with the first COPIES again (a producer's retries); with the first of
    them, every order and the first COPIES of them again."""
    queue = service.env["PAYMENTS_QUEUE"]
    stream = [payment(i) for i in payments]
    again = [payment(i) for i in payments if i < COPIES]
    for pid, body in stream + again:
        rabbit.publish(queue, body, message_id=pid)
    if payments.start == 0:
        lines = [order(i) for i in range(ORDERS)]
        await topics.produce_many(service.env["PAYMENTS_ORDERS_TOPIC"], lines + lines[:COPIES],
                                  partitions=4)  # fmt: skip


def ready(run: Run) -> None:
    """Every part of both workers ready; else what /readyz and the log said."""
    try:
        wait_for(lambda: run.status("/readyz") == 200, 180, "both workers ready")
    except AssertionError:
        raise AssertionError(f"not ready: {run.get('/readyz')}\n{run.stderr[-4000:]}") from None


def outcomes(stderr: str) -> Counter[tuple[str, str]]:
    """(consumer, outcome) of every outcome line of a JSON log at DEBUG."""
    found: Counter[tuple[str, str]] = Counter()
    for line in stderr.splitlines():
        if line.startswith("{") and '"outcome"' in line:
            record = json.loads(line)
            found[(record["consumer"], record["outcome"])] += 1
    return found


async def test_sigterm_mid_stream_then_a_restart_decides_each_message_once(
    service: Service, rabbit: Broker, topics: Topics, kafka: KafkaService
) -> None:
    args = ("--workers", "2", "--health-port", "0", "--log-format", "json", "--log-level", "DEBUG")
    first = service.start(*args)
    try:
        ready(first)
        assert first.status("/livez") == 200
        _, body = first.get("/readyz")
        assert [sorted(w["parts"]) for w in body["workers"]] == [
            ["orders", "payments", "relay"]
        ] * 2
        await publish_stream(service, rabbit, topics, payments=range(PAYMENTS // 5))
        wait_for(lambda: service.decided("payments") >= PAYMENTS // 10, 120, "some decided")
        _, metrics = first.get("/metrics")
        assert metric(metrics, "consumerdedup_messages_total", consumer="payments") > 0
        assert metric(metrics, "consumerdedup_part_ready", part="relay") == 2
        # The business table locked: the next batches block in their INSERT, in flight.
        with service.engine.connect() as lock:
            lock.execute(text(f"LOCK TABLE {service.schema}.payments IN SHARE MODE"))
            await publish_stream(service, rabbit, topics, payments=range(PAYMENTS // 5, PAYMENTS))
            wait_for(lambda: service.blocked() >= 1, 60, "a batch in flight, blocked")
            first.signal(signal.SIGTERM)
            wait_for(lambda: first.status("/readyz") == 503, 30, "not ready once stopping")
            lock.rollback()  # the batches in flight go on: they commit and are acked
        assert first.wait(60) == 0, first.stderr[-3000:]
        assert rabbit.held(service.env["PAYMENTS_QUEUE"]) == PAYMENTS + COPIES - sum(
            n for (c, _), n in outcomes(first.stderr).items() if c == "payments"
        )  # every delivery it decided was acked: none is still in the queue
    finally:
        first.stop()
    second = service.start(*args)
    try:
        wait_for(lambda: service.decided("payments") == PAYMENTS, 180, "all payments")
        wait_for(lambda: service.decided("orders") == ORDERS, 180, "all orders")
        wait_for(lambda: rabbit.ready(service.env["PAYMENTS_QUEUE"]) == 0, 60, "queue drained")
        unpublished = "SELECT count(*) FROM {s}.outbox WHERE published_at IS NULL"
        wait_for(lambda: service.scalar(unpublished) == 0, 60, "outbox relayed")
        second.signal(signal.SIGTERM)
        assert second.wait(60) == 0, second.stderr[-3000:]
    finally:
        second.stop()
    assert service.rows("payments", "payment_id") == (PAYMENTS, PAYMENTS)
    assert service.rows("order_lines", "order_id") == (ORDERS, ORDERS)
    seen = outcomes(first.stderr) + outcomes(second.stderr)
    # Exactly the copies published twice were answered DUPLICATE: nothing that committed
    # was left unacked by the graceful stop (its redelivery would be one more).
    assert seen[("payments", "processed")] == PAYMENTS
    assert seen[("payments", "duplicate")] == COPIES
    assert seen[("orders", "processed")] == ORDERS
    assert seen[("orders", "duplicate")] >= COPIES
    assert seen[("payments", "failed")] == seen[("orders", "failed")] == 0
    assert await topics.lag(service.group, service.env["PAYMENTS_ORDERS_TOPIC"]) == 0
    events = await topics.records(service.env["PAYMENTS_EVENTS_TOPIC"])
    assert len({dict(r.headers)["event_id"] for r in events}) == PAYMENTS  # relayed, at least once


async def test_a_child_killed_mid_stream_is_restarted_and_nothing_is_lost_or_doubled(
    service: Service, rabbit: Broker, topics: Topics
) -> None:
    run = service.start("--workers", "2", "--health-port", "0")
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
        _, metrics = run.get("/metrics")
        assert metric(metrics, "consumerdedup_worker_restarts_total") == 1
        # The killed child's counts stay in the sums: every payment counted as processed.
        assert metric(metrics, "consumerdedup_messages_total", consumer="payments",
                      outcome="processed") == PAYMENTS  # fmt: skip
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr[-3000:]
    finally:
        run.stop()
    assert service.rows("payments", "payment_id") == (PAYMENTS, PAYMENTS)
    assert service.rows("order_lines", "order_id") == (ORDERS, ORDERS)
    assert rabbit.held(service.env["PAYMENTS_QUEUE"]) == 0
    assert await topics.lag(service.group, service.env["PAYMENTS_ORDERS_TOPIC"]) == 0


async def test_a_group_an_earlier_test_left_wedged_on_the_broker_does_not_hold_the_service(
    service: Service, kafka: KafkaService
) -> None:
    # The tests of a process share one broker. The orders part used to join the group
    # "orders" in every test; on Tansu 0.6 workers stopped while it formed could leave it
    # wedged, and the next test's workers were never given a partition: "not ready" after
    # 180 s, both workers' orders part ticking (a CI run of the MariaDB twin). Each test's
    # service now joins a group of its own.
    await wedge(kafka, "orders", service.env["PAYMENTS_ORDERS_TOPIC"])
    run = service.start("--workers", "2", "--health-port", "0")
    try:
        ready(run)
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr[-3000:]
    finally:
        run.stop()
