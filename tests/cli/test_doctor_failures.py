"""``consumerdedup doctor`` sees messages failing (issue 38, item 11): the FAILED records
(how many, the oldest, the top reasons) and, with a broker, how many dead letters wait in
each queue's DLQ. A warn by default (exit 0); past ``--max-failed N`` a FAIL (exit 1)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import pytest

from tests.cli.test_doctor import doctor, line
from tests.conftest import Database
from tests.failed.test_records import add
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def three_failed(db: Database) -> None:
    two_hours_ago = datetime.now(UTC) - timedelta(hours=2)
    add(db, "shop", ["o1", "o2"], error="KeyError: 'sku'")
    add(db, "mail", ["m1"], error="ValueError: bad address", at=two_hours_ago)
    add(db, "shop", ["o3"], outcome="processed")


def test_failed_records_are_a_warn_line(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = doctor(db, capsys, "--retention", "7d")
    assert code == 0 and "ok    failed records" in out, out
    three_failed(db)
    code, out = doctor(db, capsys, "--retention", "7d")
    assert code == 0, out
    found = line(out, "failed records")
    assert found.startswith("  warn  failed records"), found
    assert "3 FAILED record(s)" in found and "the oldest for 2h" in found
    assert "KeyError: 'sku' (2), ValueError: bad address (1)" in found
    assert "consumerdedup failed list" in found and "failed replay" in found
    code, out = doctor(db, capsys, "--retention", "7d", "--max-failed", "2")
    assert code == 1 and line(out, "failed records").startswith("  FAIL"), out
    code, out = doctor(db, capsys, "--retention", "7d", "--max-failed", "3")
    assert code == 0, out
    code, out = doctor(db, capsys, "--retention", "7d", "--json")
    checks = {c["name"]: c for c in json.loads(out)["checks"]}
    assert checks["failed records"]["status"] == "warn"


def test_dead_letters_waiting_are_a_warn_line(
    pg: Database, rabbit: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    queue, quiet = rabbit.queue("doctor"), rabbit.queue("doctor")
    broker = ["--rabbitmq", rabbit.url, "--queues", f"{queue},{quiet}"]
    code, out = doctor(pg, capsys, "--retention", "7d", *broker)
    assert code == 0 and f"ok    dead letters       none in {queue}.dlq, {quiet}.dlq" in out, out
    for n in range(4):
        rabbit.publish(queue + ".dlq", b"{}", f"order-{n}")
    three_failed(pg)
    code, out = doctor(pg, capsys, "--retention", "7d", *broker)
    assert code == 0, out
    found = line(out, "dead letters")
    assert found.startswith("  warn") and f"4 in {queue}.dlq" in found, found
    assert "failed replay" in found
    code, out = doctor(pg, capsys, "--retention", "7d", *broker, "--max-failed", "3")
    assert code == 1 and line(out, "dead letters").startswith("  FAIL"), out


def test_a_dead_letter_queue_that_is_not_there_is_a_warn_line(
    pg: Database, rabbit: Broker, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = rabbit.queue("doctor", dead_letter=False)
    code, out = doctor(pg, capsys, "--rabbitmq", rabbit.url, "--queues", queue)
    found = line(out, "dead letters")
    assert code == 0 and found.startswith("  warn") and f"no queue {queue}.dlq" in found, out


async def test_dead_letters_on_kafka_are_those_the_replay_group_has_not_passed(
    pg: Database, kafka: KafkaService, topics: Topics, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = await topics.create("doctor")
    await topics.create(name=topic + ".dlq")
    for n in range(2):
        await topics.produce(topic + ".dlq", b"{}", event_id=f"order-{n}")
    # In a thread: the command runs its own event loop, as it does from a shell.
    broker = ["--kafka", kafka.bootstrap, "--topics", topic]
    code, out = await asyncio.to_thread(doctor, pg, capsys, *broker)
    found = line(out, "dead letters")
    assert code == 0 and found.startswith("  warn") and f"2 in {topic}.dlq" in found, out
