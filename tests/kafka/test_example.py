"""examples/kafka_consumer.py runs as shipped against the broker and PostgreSQL, and stops on
SIGTERM after committing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import ProgrammingError

from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kafka_consumer.py"


@pytest.fixture
def schema(postgres_url: str) -> Iterator[str]:
    """A schema of this test's own for the example's tables: nothing from an earlier run."""
    name = f"example_kafka_{uuid.uuid4().hex[:8]}"
    yield name
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
    engine.dispose()


def example(
    kafka: KafkaService, topic: str, postgres_url: str, schema: str, **env: str
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), topic],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=EXAMPLE.parent.parent,
        env={
            **os.environ,
            "KAFKA_BOOTSTRAP": kafka.bootstrap,
            "KAFKA_GROUP": "example-" + topic,
            "KAFKA_IDEMPOTENCE": str(int(kafka.idempotence)),
            "CONSUMERDEDUP_DB_URL": postgres_url,
            "EXAMPLE_SCHEMA": schema,
            **env,
        },
    )


def applied(postgres_url: str, schema: str) -> tuple[int, int]:
    """Rows in the example's payments table (no unique key: a double shows), and distinct ids."""
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            sql = f"SELECT count(*), count(DISTINCT event_id) FROM {schema}.payments"
            rows, distinct = conn.execute(text(sql)).one()
            return int(rows), int(distinct)
    except ProgrammingError:  # the example has not made its table yet
        return 0, 0
    finally:
        engine.dispose()


async def test_the_kafka_example_consumes_into_postgresql(
    kafka: KafkaService, topics: Topics, postgres_url: str, schema: str
) -> None:
    topic = await topics.create("example", partitions=2)
    prefix = f"pay-{uuid.uuid4().hex[:8]}-"
    payments = [(f"{prefix}{i:03d}", {"account": "alice", "amount": i}) for i in range(100)]
    stream = [(eid, json.dumps(p).encode()) for eid, p in payments + payments[:20]]
    await topics.produce_many(topic, [*stream, (prefix + "bad", b"{not json")], partitions=2)

    process = example(kafka, topic, postgres_url, schema, UNTIL_IDLE="1")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert "applied 100, duplicates 20, dead-lettered 1" in out, out + err
    assert applied(postgres_url, schema) == (100, 100)
    [dead] = await topics.records(topic + ".dlq")
    assert dict(dead.headers)["event_id"] == (prefix + "bad").encode()

    # A group reset (a new group reads the topic from the start): processed_events answers.
    again = example(
        kafka, topic, postgres_url, schema, UNTIL_IDLE="1", KAFKA_GROUP="reset-" + topic
    )
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    assert "applied 0, duplicates 120, dead-lettered 1" in out, out + err
    assert applied(postgres_url, schema) == (100, 100)
    assert len(await topics.records(topic + ".dlq")) == 2  # the recorded failure, sent again


async def test_the_kafka_example_stops_on_sigterm_after_committing(
    kafka: KafkaService, topics: Topics, postgres_url: str, schema: str
) -> None:
    topic = await topics.create("sigterm")
    prefix = f"pay-{uuid.uuid4().hex[:8]}-"
    body = json.dumps({"account": "bob", "amount": 1}).encode()
    await topics.produce_many(topic, [(f"{prefix}{i:03d}", body) for i in range(50)])

    process = example(kafka, topic, postgres_url, schema)
    deadline = time.monotonic() + 60
    while applied(postgres_url, schema)[0] < 50:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert "applied 50, duplicates 0, dead-lettered 0" in out, out + err
    assert applied(postgres_url, schema) == (50, 50)
    assert await topics.lag("example-" + topic, topic) == 0
    assert await topics.records(topic + ".dlq") == []
