"""A FastStream consumer process SIGKILLed right after a COMMIT and before FastStream's ack
(with other messages in flight on RabbitMQ), then started again: every effect once, the
killed message's redelivery answered DUPLICATE. Or SIGKILLed inside a handler, its write
flushed and not committed, with the rest of the batch in flight: the write rolled back,
the redelivery applies it; every effect and every record once. Real RabbitMQ /
Kafka-protocol broker, PostgreSQL, FastStream's own brokers in a process of their own
(faststream_worker.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from tests.conftest import Database
from tests.integrations.faststream_support import records, until
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401

WORKER = Path(__file__).with_name("faststream_worker.py")
ROOT = Path(__file__).parents[2]
COUNT = 20
KILL_AFTER = 5


class Workers:
    """The worker processes this test started; each one ended at teardown."""

    def __init__(self, spec: dict[str, Any], folder: Path) -> None:
        self.spec, self.folder = spec, folder
        self.started: list[subprocess.Popen[bytes]] = []
        self.ids: list[str] = []
        """The message ids the test sent: one processed record each."""

    def start(self, **overrides: Any) -> subprocess.Popen[bytes]:
        path = self.folder / f"spec-{len(self.started)}.json"
        path.write_text(json.dumps({**self.spec, **overrides}))
        process = subprocess.Popen([sys.executable, str(WORKER), str(path)], cwd=ROOT)
        self.started.append(process)
        return process

    def outcomes(self) -> list[tuple[str, str]]:
        outcomes = Path(self.spec["outcomes"])
        if not outcomes.exists():
            return []
        return [tuple(line.split(" ", 1)) for line in outcomes.read_text().splitlines()]  # type: ignore[misc]

    def end(self) -> None:
        for process in self.started:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)


@pytest.fixture
def workers(pg: Database, tmp_path: Path) -> Iterator[Workers]:
    spec = {
        "database": pg.async_url,
        "schema": pg.schema,
        "ledger": pg.create_ledger(),
        "outcomes": str(tmp_path / "outcomes.txt"),
    }
    made = Workers(spec, tmp_path)
    yield made
    made.end()


def _ledger(pg: Database, ledger: str) -> list[str]:
    with pg.engine.connect() as conn:
        found = conn.exec_driver_sql(f"SELECT message_id FROM {ledger} ORDER BY 1")
        return [r[0] for r in found]


async def _killed_then_restarted(workers: Workers, pg: Database) -> None:
    first = workers.start(kill_after=KILL_AFTER)
    await until(lambda: first.poll() is not None, "the first worker killed itself", 60)
    assert first.returncode == -9
    killed_at = len(workers.outcomes())
    workers.start()
    await until(
        lambda: (
            len([r for r in records(pg) if r[1] == "processed"]) == COUNT
            and any(o == "duplicate" for _, o in workers.outcomes()[killed_at:])
        ),
        "every message processed, the killed one's redelivery DUPLICATE",
        60,
    )
    refs = _ledger(pg, workers.spec["ledger"])
    assert refs == sorted(f"r-{i:02d}" for i in range(COUNT))  # each once, none twice


async def _killed_in_handler_then_restarted(workers: Workers, pg: Database) -> None:
    first = workers.start(kill_in_handler=KILL_AFTER)
    await until(lambda: first.poll() is not None, "the first worker killed itself", 60)
    assert first.returncode == -9
    workers.start()
    await until(
        lambda: len([r for r in records(pg) if r[1] == "processed"]) == COUNT,
        "every message processed",
        60,
    )
    refs = _ledger(pg, workers.spec["ledger"])
    assert refs == sorted(f"r-{i:02d}" for i in range(COUNT))  # the killed write rolled back
    assert sorted(records(pg)) == sorted((k, "processed") for k in workers.ids)


async def _publish_rabbit(url: str, queue: str) -> Any:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)  # as FastStream declares it
    for i in range(COUNT):
        body = json.dumps({"amount": i, "ref": f"r-{i:02d}"}).encode()
        channel.basic_publish("", queue, body, pika.BasicProperties(message_id=f"m-{i}"))
    return connection, channel


async def test_rabbitmq_worker_killed_in_a_handler_mid_batch(
    workers: Workers, pg: Database, amqp_url: str
) -> None:
    queue = f"fs-kill-{uuid.uuid4().hex[:10]}"
    workers.spec.update(broker="rabbit", url=amqp_url, source=queue)
    workers.ids = [f"m-{i}" for i in range(COUNT)]
    connection, channel = await _publish_rabbit(amqp_url, queue)
    try:
        await _killed_in_handler_then_restarted(workers, pg)
    finally:
        channel.queue_delete(queue)
        connection.close()


async def test_kafka_worker_killed_in_a_handler_mid_batch(
    workers: Workers, pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("fs-kill-mid")
    workers.spec.update(
        broker="kafka",
        url=kafka.bootstrap,
        source=topic,
        group=f"fs-kill-{uuid.uuid4().hex[:10]}",
        group_options=dict(kafka.group_options),
    )
    for i in range(COUNT):
        body = json.dumps({"amount": i, "ref": f"r-{i:02d}"}).encode()
        await topics.produce(topic, body, event_id=f"e-{i}")
    workers.ids = [f"e-{i}" for i in range(COUNT)]
    await _killed_in_handler_then_restarted(workers, pg)


async def test_rabbitmq_worker_killed_between_commit_and_ack(
    workers: Workers, pg: Database, amqp_url: str
) -> None:
    queue = f"fs-kill-{uuid.uuid4().hex[:10]}"
    workers.spec.update(broker="rabbit", url=amqp_url, source=queue)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)  # as FastStream declares it
        for i in range(COUNT):
            body = json.dumps({"amount": i, "ref": f"r-{i:02d}"}).encode()
            channel.basic_publish("", queue, body, pika.BasicProperties(message_id=f"m-{i}"))
        await _killed_then_restarted(workers, pg)
    finally:
        channel.queue_delete(queue)
        connection.close()


async def test_kafka_worker_killed_between_commit_and_offset_commit(
    workers: Workers, pg: Database, kafka: KafkaService, topics: Topics
) -> None:
    topic = await topics.create("fs-kill")
    workers.spec.update(
        broker="kafka",
        url=kafka.bootstrap,
        source=topic,
        group=f"fs-kill-{uuid.uuid4().hex[:10]}",
        group_options=dict(kafka.group_options),
    )
    for i in range(COUNT):
        body = json.dumps({"amount": i, "ref": f"r-{i:02d}"}).encode()
        await topics.produce(topic, body, event_id=f"e-{i}")
    await _killed_then_restarted(workers, pg)
