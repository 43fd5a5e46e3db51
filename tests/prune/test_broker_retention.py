"""Reading retention from the brokers: Kafka's retention.ms (Tansu here), RabbitMQ's message TTL."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import pika
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError

from consumerdedup import ConfigurationError
from consumerdedup.adapters.kafka.retention import read_kafka_retention, topic_retention
from consumerdedup.adapters.rabbitmq.retention import queue_retention, rabbitmq_retention
from consumerdedup.prune.windows import RetentionUnknown
from tests.support import services
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import RABBITMQCTL_NEEDED, amqp_url_fixture  # noqa: F401

HOUR_MS = 3_600_000

# --- the arithmetic, from configs as a broker reports them ---------------------------------------


def test_kafka_window_is_retention_plus_segment() -> None:
    found = topic_retention("t", {"retention.ms": "604800000", "segment.ms": "86400000"})
    assert found is not None and found.window == timedelta(days=8)
    assert "segment.ms=86400000" in found.detail


@pytest.mark.parametrize(
    "configs",
    [
        {"retention.ms": "-1", "segment.ms": "1000"},
        {"cleanup.policy": "compact", "retention.ms": "1000"},
        {"retention.ms": str(2**63 - 1)},
    ],
)
def test_kafka_topics_that_keep_records_forever(configs: dict[str, str]) -> None:
    found = topic_retention("t", configs)
    assert found is not None and found.window is None


def test_kafka_compact_and_delete_uses_the_retention() -> None:
    found = topic_retention("t", {"cleanup.policy": "compact,delete", "retention.ms": "1000"})
    assert found is not None and found.window == timedelta(seconds=1)


def test_rabbitmq_the_lower_ttl_applies() -> None:
    found = queue_retention("q", {"x-message-ttl": 7200000}, {"message-ttl": HOUR_MS})
    assert found is not None and found.window == timedelta(hours=1)
    assert queue_retention("q", {}, None) is None
    assert queue_retention("q", {"x-queue-type": "stream", "x-max-age": "7D"}, None) is None


# --- Kafka: the admin client against a real Kafka-protocol broker --------------------------------


@pytest.fixture
async def topic_factory(kafka: KafkaService) -> AsyncIterator[Any]:
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    made: list[str] = []

    async def make(**configs: str) -> str:
        name = f"cdd-ret-{uuid.uuid4().hex[:10]}"
        await admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs)])
        made.append(name)
        return name

    yield make
    with contextlib.suppress(Exception):  # a broker that cannot delete topics keeps them
        await admin.delete_topics(made)
    await admin.close()


async def test_kafka_retention_is_the_longest_of_the_topics(
    kafka: KafkaService, topic_factory: Any
) -> None:
    short = await topic_factory(**{"retention.ms": str(HOUR_MS)})
    long = await topic_factory(**{"retention.ms": str(5 * HOUR_MS), "segment.ms": str(HOUR_MS)})
    found = await read_kafka_retention(kafka.bootstrap, [short, long])
    assert found.window == timedelta(hours=6)
    assert [s.source for s in found.sources] == [short, long]


async def test_kafka_infinite_retention_means_forever(
    kafka: KafkaService, topic_factory: Any
) -> None:
    finite = await topic_factory(**{"retention.ms": str(HOUR_MS)})
    infinite = await topic_factory(**{"retention.ms": "-1"})
    found = await read_kafka_retention(kafka.bootstrap, f"{finite},{infinite}")
    assert found.window is None
    assert [s.source for s in found.forever] == [infinite]


async def test_kafka_silent_about_retention_is_an_error_that_says_so(
    kafka: KafkaService, topic_factory: Any
) -> None:
    """A topic created without retention.ms: Tansu reports only configs set on the topic, so
    the window is unknown; a real Kafka reports its default, so the window is read."""
    plain = await topic_factory()
    if kafka.kind != "tansu":
        found = await read_kafka_retention(kafka.bootstrap, [plain])
        assert [s.source for s in found.sources] == [plain]
        assert "retention.ms=" in found.sources[0].detail
        return
    with pytest.raises(RetentionUnknown, match=rf"no retention.ms for topic\(s\) {plain}"):
        await read_kafka_retention(kafka.bootstrap, [plain])


async def test_kafka_unknown_topic_is_a_configuration_error(kafka: KafkaService) -> None:
    with pytest.raises(ConfigurationError, match="do not exist"):
        await read_kafka_retention(kafka.bootstrap, [f"cdd-missing-{uuid.uuid4().hex}"])


async def test_kafka_unreachable_broker_is_a_driver_error() -> None:
    with pytest.raises((KafkaConnectionError, TimeoutError)):
        await read_kafka_retention("127.0.0.1:1", ["t"], timeout=5)


# --- RabbitMQ: rabbitmqctl on this host --------------------------------------------------------


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args, "--quiet"], check=True, capture_output=True, timeout=60)


@pytest.fixture
def queues(amqp_url: str) -> Iterator[Any]:
    services.tool("rabbitmqctl", RABBITMQCTL_NEEDED)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    made: list[str] = []
    policies: list[str] = []

    def make(arguments: dict[str, Any] | None = None, policy_ttl: int | None = None) -> str:
        name = f"cdd-ret-{uuid.uuid4().hex[:10]}"
        channel.queue_declare(name, arguments=arguments)
        made.append(name)
        if policy_ttl is not None:
            policies.append(f"{name}-policy")
            definition = f'{{"message-ttl": {policy_ttl}}}'
            rabbitmqctl("set_policy", "--apply-to", "queues", policies[-1], f"^{name}$", definition)
        return name

    yield make
    for policy in policies:
        rabbitmqctl("clear_policy", policy)
    for name in made:
        channel.queue_delete(name)
    connection.close()


def test_rabbitmq_ttl_from_arguments_and_policies(amqp_url: str, queues: Any) -> None:
    by_argument = queues({"x-message-ttl": 2 * HOUR_MS})
    by_policy = queues(policy_ttl=3 * HOUR_MS)
    both = queues({"x-message-ttl": 5 * HOUR_MS}, policy_ttl=4 * HOUR_MS)
    found = rabbitmq_retention(amqp_url, [by_argument, by_policy, both])
    windows = {s.source: s.window for s in found.sources}
    assert windows == {
        by_argument: timedelta(hours=2),
        by_policy: timedelta(hours=3),
        both: timedelta(hours=4),
    }
    assert found.window == timedelta(hours=4)


def test_rabbitmq_queue_without_ttl_needs_an_explicit_retention(amqp_url: str, queues: Any) -> None:
    plain = queues()
    with pytest.raises(RetentionUnknown, match=f"{plain}.*no message TTL"):
        rabbitmq_retention(amqp_url, [queues({"x-message-ttl": HOUR_MS}), plain])


def test_rabbitmq_unknown_queue_and_missing_tool(amqp_url: str, queues: Any) -> None:
    with pytest.raises(ConfigurationError, match="do not exist"):
        rabbitmq_retention(amqp_url, [f"cdd-missing-{uuid.uuid4().hex}"])
    with pytest.raises(RetentionUnknown, match="give the retention explicitly"):
        rabbitmq_retention(amqp_url, [queues()], rabbitmqctl=["/nonexistent/rabbitmqctl"])
