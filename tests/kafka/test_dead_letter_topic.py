"""A dead-letter topic that does not exist and cannot be created stops the runner, at once
and with a clear error (issue 38, item 5); real broker and PostgreSQL.

Before: the runner took it for "topic not there yet": the first send waited 40 s
(aiokafka's request_timeout_ms) while aiokafka logged an ERROR line every 100 ms, then the
partition was read again from the FAILED record after 1, 2, 4, 8... s, forever, and
``run(until_idle=True)`` never returned. Now the broker is asked about a dead-letter topic
before the first dead letter to it, and a topic it does not have and will not create is
``DeadLetterMissing`` (a ConfigurationError): run() raises it, the FAILED record's offset
uncommitted, and once the topic is fixed the restarted runner dead-letters the record.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient

from consumerdedup import ConfigurationError, Outcome
from consumerdedup.adapters.kafka import DeadLetterMissing, KafkaConsumerRunner
from consumerdedup.headers import REASON_HEADER
from tests.kafka.test_runner import FAST, Ledger, body
from tests.support.kafka_doubles import no_auto_create
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)


@pytest.fixture(name="ledger")
async def ledger_fixture(pg: Any) -> AsyncIterator[Ledger]:
    ledger = Ledger(pg)
    yield ledger
    await ledger.close()


QUICK = 15.0
"""Seconds within which run() must stop (the check asks the broker; no 40 s wait)."""


async def three_records(topics: Topics, prefix: str) -> str:
    """A topic with m-1, m-2 (which the handler refuses for good) and m-3."""
    topic = await topics.create(prefix)
    for n in (1, 2, 3):
        await topics.produce(topic, body(n, fail="poison" if n == 2 else None), event_id=f"m-{n}")
    return topic


def runner_to(
    kafka: KafkaService, ledger: Ledger, topic: str, dead_letter_topic: str, *, bypass: bool
) -> KafkaConsumerRunner:
    config = kafka.config(**FAST)
    if bypass:
        # A name our construction-time check would refuse, set past it: how a broker whose
        # rules are stricter than ours (a topic policy, a name colliding with another once
        # '.' and '_' are folded) answers at run time. Tansu checks names as Kafka does and
        # refuses none of those our check lets through, so this is the one way to reach the
        # run-time path on it.
        object.__setattr__(config, "dead_letter_topic", dead_letter_topic)
    else:
        config = kafka.config(**FAST, dead_letter_topic=dead_letter_topic)
    return KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id="group-" + topic,
        config=config,
    )


async def stops_with(run: KafkaConsumerRunner, match: str) -> tuple[DeadLetterMissing, float]:
    started = time.monotonic()
    with pytest.raises(DeadLetterMissing, match=match) as raised:
        await asyncio.wait_for(run.run(until_idle=True), 60)
    return raised.value, time.monotonic() - started


async def test_a_dead_letter_topic_the_broker_refuses_stops_run_at_once_without_a_log_flood(
    kafka: KafkaService, topics: Topics, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    topic = await three_records(topics, "dlq-refused")
    refused = runner_to(kafka, ledger, topic, "{topic} dlq", bypass=True)
    error, took = await stops_with(refused, "InvalidTopicError")
    assert isinstance(error, ConfigurationError)
    assert f"{topic} dlq" in str(error) and "KafkaConfig(dead_letter_topic=...)" in str(error)
    assert took < QUICK
    flood = [r for r in caplog.records if "not a valid topic name" in r.getMessage()]
    assert flood == []  # aiokafka's line, every 100 ms for 40 s, before
    # The FAILED record is kept and not acked: nothing past it (nor the chunk's) committed.
    assert await topics.committed(refused.group_id, topic) == {0: 0}
    assert "m-2" in ledger.recorded()

    fixed = runner_to(kafka, ledger, topic, "{topic}.dlq", bypass=False)
    await asyncio.wait_for(fixed.run(until_idle=True), 60)
    [dead] = await topics.records(topic + ".dlq")
    assert dict(dead.headers)[REASON_HEADER] == b"RecordedFailure: PermanentError: poison"
    assert sorted(ledger.applied()) == ["m-1", "m-3"]  # once each: read again as DUPLICATE
    assert fixed.outcomes[Outcome.DUPLICATE] == 2
    assert await topics.committed(fixed.group_id, topic) == {0: 3}


async def test_a_dead_letter_topic_a_broker_without_auto_create_lacks_stops_run_at_once(
    kafka: KafkaService,
    topics: Topics,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """auto.create.topics.enable=false (a double: Tansu creates every topic it is asked
    about, so its producer and metadata requests are made not to): DeadLetterMissing names
    the topic and says to create it; once created, the restarted runner dead-letters."""
    caplog.set_level(logging.INFO)
    no_auto_create(monkeypatch)
    topic = await three_records(topics, "dlq-missing")
    missing = topic + ".missing"
    topics.names.append(missing)  # deleted at teardown
    absent = runner_to(kafka, ledger, topic, "{topic}.missing", bypass=False)
    error, took = await stops_with(absent, "does not exist and the broker does not create it")
    assert repr(missing) in str(error) and "create it" in str(error)
    assert took < QUICK
    assert await topics.records(missing) == []
    assert await topics.committed(absent.group_id, topic) == {0: 0}
    assert not [r for r in caplog.records if "not found in cluster metadata" in r.getMessage()]

    await topics.create(name=missing)
    created = runner_to(kafka, ledger, topic, "{topic}.missing", bypass=False)
    await asyncio.wait_for(created.run(until_idle=True), 60)
    [dead] = await topics.records(missing)
    assert dict(dead.headers)[REASON_HEADER] == b"RecordedFailure: PermanentError: poison"
    assert sorted(ledger.applied()) == ["m-1", "m-3"]
    assert await topics.committed(created.group_id, topic) == {0: 3}


async def test_a_dead_letter_topic_the_broker_creates_on_demand_is_used(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """The check asks as a send would, letting the broker create the topic (Tansu does):
    a topic not there yet on such a broker is no fault."""
    topic = await three_records(topics, "dlq-auto")
    auto = topic + ".auto"
    topics.names.append(auto)
    run = runner_to(kafka, ledger, topic, "{topic}.auto", bypass=False)
    await asyncio.wait_for(run.run(until_idle=True), 60)
    [dead] = await topics.records(auto)
    assert dict(dead.headers)[REASON_HEADER] == b"PermanentError: poison"
    assert await topics.committed(run.group_id, topic) == {0: 3}


async def test_a_dead_letter_topic_deleted_while_running_stops_run_where_it_is_not_recreated(
    kafka: KafkaService, topics: Topics, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked once per run, then deleted (auto-create off, the double as above): the next
    dead letter's send finds it missing (TopicMissing), it is asked about again, and
    DeadLetterMissing stops run() instead of a partition read again forever."""
    no_auto_create(monkeypatch)
    topic = await topics.create("dlq-deleted")
    await topics.produce(topic, body(1, fail="poison"), event_id="m-1")
    run = runner_to(kafka, ledger, topic, "{topic}.dlq", bypass=False)
    task = asyncio.create_task(run.run())
    try:
        deadline = time.monotonic() + 60
        while not await topics.records(topic + ".dlq"):
            assert time.monotonic() < deadline and not task.done(), "m-1 not dead-lettered"
            await asyncio.sleep(0.1)
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic + ".dlq"])
        finally:
            await admin.close()
        await topics.produce(topic, body(2, fail="poison"), event_id="m-2")
        with pytest.raises(DeadLetterMissing, match="does not exist"):
            await asyncio.wait_for(task, 60)
    finally:
        run.stop()
        await asyncio.gather(task, return_exceptions=True)
    assert await topics.committed(run.group_id, topic) == {0: 1}  # m-1's, not m-2's
    assert ledger.recorded() == {"m-1", "m-2"}
