"""Issue 38 items 3, 5 (construction) and 7, case by case as the issue reproduced them:
each is a ConfigurationError at construction naming the option, what was given and what
is expected (test_option_walk.py walks every option; these are the reported ones)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    OutboxRelay,
    Pruner,
    RelayConfig,
    RetryPolicy,
)
from consumerdedup.testing import MemoryBroker, MemoryConfig

kafka = pytest.importorskip("consumerdedup.adapters.kafka")
rabbitmq = pytest.importorskip("consumerdedup.adapters.rabbitmq")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, AsyncEngine]]:
    path = Path(tmp_path_factory.mktemp("issue38")) / "db.sqlite"
    engine = create_engine(f"sqlite:///{path}")
    yield engine, create_async_engine(f"sqlite+aiosqlite:///{path}")
    engine.dispose()


def refused(build: Callable[[], object], *said: str) -> str:
    with pytest.raises(ConfigurationError) as caught:
        build()
    text = str(caught.value)
    for part in said:
        assert part in text, text
    return text


Relay: Any = RelayConfig  # called with what its hints refuse: that is the point

# Item 3: booleans are booleans, integers are integers, durations timedelta.
CONFIG_CASES: list[tuple[Callable[[], object], tuple[str, ...]]] = [
    (lambda: Relay(delete_published="no"), ("RelayConfig.delete_published", "'no' (str)")),
    (lambda: Relay(batch_size=1.5), ("RelayConfig.batch_size", "1.5 (float)")),
    (lambda: Relay(batch_size=True), ("RelayConfig.batch_size", "True (bool)")),
    (lambda: Relay(batch_size="100"), ("RelayConfig.batch_size", "'100' (str)")),
    (lambda: Relay(poll_interval=5), ("RelayConfig.poll_interval", "5 (int)", "timedelta")),
    (lambda: kafka.KafkaConfig(coordinates_as_id="no"), ("KafkaConfig.coordinates_as_id",)),
    (lambda: kafka.KafkaConfig(idempotent_producer=0), ("KafkaConfig.idempotent_producer",)),
    (lambda: kafka.KafkaConfig(retry_delay=1), ("KafkaConfig.retry_delay", "1 (int)")),
    (lambda: rabbitmq.RabbitConfig(declare="false"), ("RabbitConfig.declare", "'false' (str)")),
    (
        lambda: rabbitmq.RabbitConfig(idle_timeout=timedelta(0)),
        ("RabbitConfig.idle_timeout", "> 0"),
    ),
    (lambda: MemoryConfig(batch_size=True), ("MemoryConfig.batch_size", "True (bool)")),
    (lambda: RetryPolicy(transient=ValueError("x")), ("RetryPolicy.transient",)),  # type: ignore[arg-type]
    # Item 5: a dead-letter name the broker can never have stops the stream for good.
    (
        lambda: kafka.KafkaConfig(dead_letter_topic="a b"),
        ("KafkaConfig.dead_letter_topic", "'a b'"),
    ),
    (lambda: kafka.KafkaConfig(dead_letter_topic=".."), ("KafkaConfig.dead_letter_topic", "'..'")),
    (lambda: kafka.KafkaConfig(dead_letter_topic="x" * 250), ("KafkaConfig.dead_letter_topic",)),
    (lambda: kafka.KafkaConfig(dead_letter_topic="{topic}.dlq?"), ("dead_letter_topic",)),
    (
        lambda: rabbitmq.RabbitConfig(dead_letter_exchange="dead letters"),
        ("RabbitConfig.dead_letter_exchange", "'dead letters'"),
    ),
    (
        lambda: rabbitmq.RabbitConfig(dead_letter_exchange="amq.dead", declare=True),
        ("RabbitConfig.dead_letter_exchange", "amq."),
    ),
    # Item 2's class: a string, a dict or a list where a collection or a mapping belongs.
    (lambda: rabbitmq.RabbitConfig(queue_arguments="x"), ("RabbitConfig.queue_arguments",)),
    (lambda: rabbitmq.RabbitConfig(connection_options=[("heartbeat", 1)]), ("connection_options",)),
    (lambda: kafka.KafkaConfig(consumer_options="x"), ("KafkaConfig.consumer_options",)),
]


@pytest.mark.parametrize(("build", "said"), CONFIG_CASES)
def test_the_reported_config_values_are_refused(
    build: Callable[[], object], said: tuple[str, ...]
) -> None:
    refused(build, *said, "expected")


def test_the_right_values_are_kept() -> None:
    assert RelayConfig(delete_published=True).delete_published is True
    assert (
        kafka.KafkaConfig(dead_letter_topic="dlq-{topic}_x.y").dead_letters_of("t") == "dlq-t_x.y"
    )
    assert rabbitmq.RabbitConfig(dead_letter_exchange="dlx.orders:v1").dead_letter_exchange
    assert rabbitmq.RabbitConfig(dead_letter_exchange="amq.direct").declare is False


def test_an_engine_of_the_other_kind_names_the_other_deduplicator(
    engines: tuple[Engine, AsyncEngine],
) -> None:
    engine, async_engine = engines
    refused(lambda: Deduplicator(async_engine, "c"), "Deduplicator.engine", "AsyncDeduplicator")  # type: ignore[arg-type]
    refused(lambda: AsyncDeduplicator(engine, "c"), "AsyncDeduplicator.engine", "to Deduplicator")  # type: ignore[arg-type]


@pytest.mark.parametrize("driver", ["blocking", "asyncio"])
def test_both_deduplicators_refuse_the_same_options_the_same_way(
    engines: tuple[Engine, AsyncEngine], driver: str
) -> None:
    kind: Any = Deduplicator if driver == "blocking" else AsyncDeduplicator
    engine = engines[0] if driver == "blocking" else engines[1]
    name = kind.__name__
    refused(lambda: kind(engine, "c", tables="x"), f"{name}.tables", "'x' (str)")
    refused(lambda: kind(engine, "c", observers="x"), f"{name}.observers", "'x' (str)")
    refused(lambda: kind(engine, "c", observers=[print, 5]), f"{name}.observers[1]")
    refused(lambda: kind(engine, "c", retry={}), f"{name}.retry", "{} (dict)")
    refused(lambda: kind(engine, "c", dead_letter="log"), f"{name}.dead_letter")
    refused(lambda: kind(engine, "c", session_factory="x"), f"{name}.session_factory")
    refused(lambda: kind(engine, 5), f"{name}.consumer", "5 (int)")
    dedup = kind(engine, "c")
    refused(lambda: dedup.handler(claim_first="no"), f"{name}.handler(claim_first)", "'no'")
    refused(lambda: dedup.handler("not a function"), "handler(fn)", "(str)")
    refused(lambda: dedup.bulk_handler(5), "handler(fn)", "(int)")


def test_the_relay_and_the_pruner_refuse_what_they_cannot_use(
    engines: tuple[Engine, AsyncEngine],
) -> None:
    engine, async_engine = engines
    refused(lambda: OutboxRelay(engine, MemoryBroker(), config={}), "OutboxRelay.config", "(dict)")  # type: ignore[arg-type]
    refused(lambda: OutboxRelay(engine, "amqp://x"), "OutboxRelay.publisher", "(str)")  # type: ignore[arg-type]
    refused(lambda: OutboxRelay(engine, MemoryBroker), "OutboxRelay.publisher", "MemoryBroker")  # type: ignore[arg-type]
    refused(lambda: OutboxRelay(async_engine, MemoryBroker()), "OutboxRelay.engine")  # type: ignore[arg-type]
    refused(lambda: Pruner(engine, timedelta(days=1), windows=["a"]), "PrunerConfig.windows")  # type: ignore[arg-type]
    refused(lambda: Pruner(engine, timedelta(days=1), tables="x"), "Pruner.tables")  # type: ignore[arg-type]
    refused(lambda: Pruner(engine, 7), "PrunerConfig.retention", "7 (int)")  # type: ignore[arg-type]


def test_the_runners_refuse_names_the_broker_cannot_have(
    engines: tuple[Engine, AsyncEngine],
) -> None:
    handler = Deduplicator(engines[0], "c").handler(lambda message, session: None)
    refused(
        lambda: kafka.KafkaConsumerRunner(handler, "a b"), "KafkaConsumerRunner.topics", "'a b'"
    )
    refused(lambda: kafka.KafkaConsumerRunner(handler, {"t": 1}), "KafkaConsumerRunner.topics")
    assert kafka.KafkaConsumerRunner(handler, "orders").topics == ("orders",)  # one topic
    refused(
        lambda: rabbitmq.RabbitConsumerRunner(handler, "q", config={}),
        "RabbitConsumerRunner.config",
    )
    refused(
        lambda: rabbitmq.RabbitPublisher(attempts=True), "RabbitPublisher.attempts", "True (bool)"
    )
    refused(
        lambda: kafka.KafkaPublisher(enable_idempotence="no"), "KafkaPublisher.enable_idempotence"
    )
