"""KafkaPublisher asks the broker about a topic before its first send (issue 38, item 5:
aiokafka's log flood contained on the relay's path too); real broker.

Handed to the producer, a topic the broker does not have and will not create, or whose
name it refuses, made aiokafka wait ``request_timeout_ms`` (40 s) for it while it logged an
ERROR line every 100 ms (392 for one outbox event with destination "bad topic", measured),
and the relay's whole round waited with it. Now the publisher's metadata request answers
at once: TopicMissing (auto-create off) or TopicRefused (a PublishRefused: the name), the
event is charged alone and the others go.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay
from consumerdedup.adapters.kafka import KafkaPublisher, PublishRefused, TopicMissing, TopicRefused
from consumerdedup.outbox.publisher import Outgoing
from tests.support.kafka_doubles import no_auto_create
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

QUICK = 15.0
"""Seconds: an answer from one metadata request, not aiokafka's 40 s wait. Generous (it was
5 s): a metadata round trip to a broker on a loaded 2-core machine is the only cost, and
15 s still tells it from the 40 s wait (as test_dead_letter_topic's QUICK)."""
FLOOD = "not a valid topic name"
"""aiokafka's ERROR line for a topic name the broker refuses."""


def flood(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if FLOOD in r.getMessage()]


async def test_a_topic_name_the_broker_refuses_is_topic_refused_at_once(
    kafka: KafkaService, topics: Topics, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    present = await topics.create("present")
    async with KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence) as publisher:
        started = time.monotonic()
        with pytest.raises(TopicRefused, match="InvalidTopicError") as caught:
            await publisher.publish("bad topic", b"x")
        assert time.monotonic() - started < QUICK
        assert isinstance(caught.value, PublishRefused)  # this event can never go
        window = [
            Outgoing("bad topic", b"1", "k", {}),
            Outgoing(present, b"2", "j", {}),
            Outgoing("bad topic", b"3", None, {}),
        ]
        started = time.monotonic()
        outcomes = await publisher.publish_window(window)
        assert time.monotonic() - started < QUICK
    assert isinstance(outcomes[0], TopicRefused) and isinstance(outcomes[2], TopicRefused)
    assert outcomes[1] is None
    assert [r.value for r in await topics.records(present)] == [b"2"]
    assert flood(caplog) == []


async def test_a_topic_a_broker_without_auto_create_lacks_is_topic_missing_at_once(
    kafka: KafkaService, topics: Topics, monkeypatch: pytest.MonkeyPatch
) -> None:
    double = no_auto_create(monkeypatch)
    missing = f"cdd-missing-{uuid.uuid4().hex[:10]}"
    topics.names.append(missing)
    async with KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence) as publisher:
        started = time.monotonic()
        with pytest.raises(TopicMissing, match=f"{missing!r} does not exist"):
            await publisher.publish(missing, b"x")
        assert time.monotonic() - started < QUICK
        assert double.refused == []  # never handed to the producer
        await topics.create(name=missing)  # an operator creates it: its events go
        await publisher.publish(missing, b"y")
    assert [r.value for r in await topics.records(missing)] == [b"y"]


async def test_the_relay_charges_an_event_for_a_refused_topic_alone_and_at_once(
    kafka: KafkaService, topics: Topics, pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    good = await topics.create("good")
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session, session.begin():
        outbox.add(session, "bad topic", b"bad", key="k1")
        outbox.add(session, good, b"good", key="k2")
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)

    def one_round() -> int:
        with OutboxRelay(pg.engine, publisher, tables=pg.tables) as relay:
            return relay.run_once()

    started = time.monotonic()
    assert await asyncio.to_thread(one_round) == 1
    assert time.monotonic() - started < QUICK  # 40 s before
    assert [r.value for r in await topics.records(good)] == [b"good"]
    with pg.engine.connect() as conn:
        [bad] = [r for r in conn.execute(select(pg.tables.outbox)) if r.body == b"bad"]
    assert bad.attempts == 1 and bad.published_at is None
    assert "TopicRefused" in bad.last_error and "InvalidTopicError" in bad.last_error
    assert flood(caplog) == []  # 392 lines before
