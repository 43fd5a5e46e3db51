"""The two adapters are twins: the same files, and the same name and default for the same concept.

A difference that is the broker's own (Kafka's coordinates as an id, RabbitMQ's prefetch)
stays; a difference in how the same thing is spelt or defaulted is a trap for whoever
moves from one broker to the other. The MemoryBroker's runner is their twin too: what
passes on it in a test is configured as it will be in production.
"""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta
from pathlib import Path

import pytest

import consumerdedup
from consumerdedup.adapters import kafka, rabbitmq
from consumerdedup.testing import MemoryConfig, MemoryConsumerRunner

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
SAME_CONCEPTS = ("batch_size", "retry_delay", "max_retry_delay", "id_header", "key")
MEMORY_HAS_NO = {"id_header", "key"}  # the MemoryBroker stores a message's id with it
RUNNERS = {
    kafka.KafkaConsumerRunner: kafka.KafkaConfig,
    rabbitmq.RabbitConsumerRunner: rabbitmq.RabbitConfig,
    MemoryConsumerRunner: MemoryConfig,
}


# A file only one adapter has, and why the other has no counterpart: the broker's own.
BROKER_OWN = {
    "kafka": {
        # The idempotent producer's session errors (fenced, epoch, sequence): AMQP has none.
        "publish_failures.py",
        # Offsets in the database (KafkaConfig(offsets="database")): a partition's next
        # offset and its owner epoch; a RabbitMQ queue has no offsets nor assignment.
        "offsets.py",
        "ownership.py",
    },
    "rabbitmq": {
        # Publisher confirms by delivery tag; Kafka's acks come back on each send's future.
        "confirms.py",
        # An AMQP message's exchange, routing key and properties, held to the frame size.
        "outgoing.py",
        # Heartbeats for an idle publisher: pika's BlockingConnection answers them only while
        # it is called; aiokafka's clients run their own background tasks.
        "keepalive.py",
    },
}


def test_each_adapter_has_the_same_files() -> None:
    files = {
        name: {p.name for p in (ADAPTERS / name).glob("*.py")} - BROKER_OWN[name]
        for name in ("kafka", "rabbitmq")
    }
    assert files["kafka"] == files["rabbitmq"]
    for name, own in BROKER_OWN.items():
        assert all((ADAPTERS / name / file).exists() for file in own), "a stale BROKER_OWN entry"


def test_the_same_concept_has_the_same_name_and_default() -> None:
    fields = {
        config: {f.name: f for f in dataclasses.fields(config)}
        for config in (kafka.KafkaConfig, rabbitmq.RabbitConfig)
    }
    for name in SAME_CONCEPTS:
        assert name in fields[kafka.KafkaConfig] and name in fields[rabbitmq.RabbitConfig], name
        assert getattr(kafka.KafkaConfig(), name) == getattr(rabbitmq.RabbitConfig(), name), name


def test_the_memory_config_spells_and_defaults_each_field_as_a_broker_does() -> None:
    """Each MemoryConfig field is a field of KafkaConfig or RabbitConfig, of the same type and
    default; and it has every shared concept but the id's whereabouts."""
    memory = {f.name: f for f in dataclasses.fields(MemoryConfig)}
    brokers = [
        {f.name: f for f in dataclasses.fields(config)}
        for config in (kafka.KafkaConfig, rabbitmq.RabbitConfig)
    ]
    for name, field in memory.items():
        twins = [fields[name] for fields in brokers if name in fields]
        assert twins, f"MemoryConfig.{name} is spelt like no broker's field"
        for twin in twins:
            assert (field.type, field.default) == (twin.type, twin.default), name
    assert set(SAME_CONCEPTS) - MEMORY_HAS_NO <= memory.keys()


def test_the_runners_take_their_arguments_in_the_same_order() -> None:
    """(handler, <its source>, *, <where the broker is>..., config=None, before_ack=None)."""
    for runner, config in RUNNERS.items():
        params = list(inspect.signature(runner).parameters.values())
        handler, source, *where, config_param, before_ack = params
        assert (handler.name, str(handler.annotation)) == ("handler", "Handler"), runner
        assert source.name in {"topics", "queue"}, runner
        assert {handler.kind, source.kind} == {inspect.Parameter.POSITIONAL_OR_KEYWORD}, runner
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), runner
        assert where, f"{runner.__name__} is not told where its broker is"
        assert (config_param.name, config_param.default) == ("config", None), runner
        assert config_param.annotation == f"{config.__name__} | None", runner
        assert (before_ack.name, before_ack.default) == ("before_ack", None), runner
        assert before_ack.annotation == "BeforeAck | None", runner


def test_dead_letters_and_redeliveries_are_named_and_backed_off_alike() -> None:
    assert kafka.KafkaConfig().dead_letters_of("orders") == "orders.dlq"
    assert rabbitmq.RabbitConfig().dead_letters_of("orders") == "orders.dlq"
    assert kafka.KafkaConfig().redelivery_backoff == rabbitmq.RabbitConfig().redelivery_backoff
    assert MemoryConfig().redelivery_backoff == rabbitmq.RabbitConfig().redelivery_backoff


def test_both_adapters_raise_the_core_errors() -> None:
    for adapter in (kafka, rabbitmq):
        assert issubclass(adapter.BrokerUnavailable, consumerdedup.BrokerUnavailable)
        assert issubclass(adapter.PublishFailed, consumerdedup.ConsumerDedupError)
    assert issubclass(kafka.TopicMissing, consumerdedup.DestinationMissing)
    assert issubclass(rabbitmq.Unroutable, consumerdedup.DestinationMissing)
    assert issubclass(rabbitmq.ExchangeMissing, consumerdedup.DestinationMissing)
    for adapter in (kafka, rabbitmq):  # a dead letter with nowhere to go: a setup fault
        assert issubclass(adapter.DeadLetterMissing, consumerdedup.ConfigurationError)


def test_both_adapters_export_the_same_kinds_of_things() -> None:
    shared = {
        "BrokerUnavailable",
        "DeadLetterMissing",
        "PublishFailed",
        "KeyFunction",
        "SOURCE_HEADER",
    }
    assert shared <= set(kafka.__all__) and shared <= set(rabbitmq.__all__)
    assert isinstance(kafka.KafkaPublisher(), consumerdedup.AsyncPublisher)
    assert isinstance(rabbitmq.RabbitPublisher(), consumerdedup.Publisher)


def test_the_old_spellings_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match="retry_delay"):
        config = kafka.KafkaConfig(retry_backoff=timedelta(seconds=2))
    assert config.retry_delay == timedelta(seconds=2)
    assert dataclasses.replace(config, retry_delay=timedelta(0)).retry_delay == timedelta(0)
    with pytest.warns(DeprecationWarning, match="dead_letters_of"):
        assert rabbitmq.RabbitConfig().dlq("orders") == "orders.dlq"
