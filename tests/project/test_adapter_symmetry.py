"""The two adapters are twins: the same files, and the same name and default for the same concept.

A difference that is the broker's own (Kafka's coordinates as an id, RabbitMQ's prefetch)
stays; a difference in how the same thing is spelt or defaulted is a trap for whoever
moves from one broker to the other.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import pytest

import consumerdedup
from consumerdedup.adapters import kafka, rabbitmq

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
SAME_CONCEPTS = ("batch_size", "retry_delay", "max_retry_delay", "id_header", "key")


def test_each_adapter_has_the_same_files() -> None:
    files = {
        name: {p.name for p in (ADAPTERS / name).glob("*.py")} for name in ("kafka", "rabbitmq")
    }
    assert files["kafka"] == files["rabbitmq"]


def test_the_same_concept_has_the_same_name_and_default() -> None:
    fields = {
        config: {f.name: f for f in dataclasses.fields(config)}
        for config in (kafka.KafkaConfig, rabbitmq.RabbitConfig)
    }
    for name in SAME_CONCEPTS:
        assert name in fields[kafka.KafkaConfig] and name in fields[rabbitmq.RabbitConfig], name
        assert getattr(kafka.KafkaConfig(), name) == getattr(rabbitmq.RabbitConfig(), name), name


def test_dead_letters_and_redeliveries_are_named_and_backed_off_alike() -> None:
    assert kafka.KafkaConfig().dead_letters_of("orders") == "orders.dlq"
    assert rabbitmq.RabbitConfig().dead_letters_of("orders") == "orders.dlq"
    assert kafka.KafkaConfig().redelivery_backoff == rabbitmq.RabbitConfig().redelivery_backoff


def test_both_adapters_raise_the_core_errors() -> None:
    for adapter in (kafka, rabbitmq):
        assert issubclass(adapter.BrokerUnavailable, consumerdedup.BrokerUnavailable)
        assert issubclass(adapter.PublishFailed, consumerdedup.ConsumerDedupError)
    assert issubclass(kafka.TopicMissing, consumerdedup.DestinationMissing)
    assert issubclass(rabbitmq.Unroutable, consumerdedup.DestinationMissing)
    assert issubclass(rabbitmq.ExchangeMissing, consumerdedup.DestinationMissing)


def test_both_adapters_export_the_same_kinds_of_things() -> None:
    shared = {"BrokerUnavailable", "PublishFailed", "KeyFunction", "SOURCE_HEADER"}
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
