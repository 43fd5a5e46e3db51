"""The Kafka adapter's blocking helpers (``missing_topics``, ``kafka_retention``) called
from a thread that runs an event loop: ``asyncio.run`` refuses there, and the coroutine
built for it was left never awaited ("coroutine 'wait_for' was never awaited", from
``App.check()`` in an async test). Now they refuse with a ConfigurationError naming the
coroutine to await, before building any; from a thread they answer as before."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from consumerdedup import ConfigurationError
from consumerdedup.adapters.kafka.retention import kafka_retention
from consumerdedup.adapters.kafka.topology import missing_topics
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

# A coroutine left unawaited is a RuntimeWarning at collection: an error here.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")


async def test_inside_a_running_loop_they_refuse_and_leave_no_coroutine() -> None:
    with pytest.raises(ConfigurationError, match=r"missing_topics\(\).*read_missing_topics"):
        missing_topics("127.0.0.1:1", ["t"])
    with pytest.raises(ConfigurationError, match=r"kafka_retention\(\).*read_kafka_retention"):
        kafka_retention("127.0.0.1:1", ["t"])


async def test_from_a_thread_they_ask_the_broker(kafka: KafkaService, topics: Topics) -> None:
    topic = await topics.create("blocking")
    missing = f"cdd-missing-{uuid.uuid4().hex[:10]}"
    found = await asyncio.to_thread(missing_topics, kafka.bootstrap, [topic, missing])
    assert found == [missing]
