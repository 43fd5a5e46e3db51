"""Bad input to an App: a ConfigurationError when it is declared, naming the thing and the fix."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from consumerdedup import App, ConfigurationError, Deduplicator
from tests.conftest import Database


class Payment(BaseModel):
    amount: int


def handle(message: Any, session: Any) -> None:
    pass


def other(message: Any, session: Any) -> None:
    pass


def test_two_consumers_with_one_name_are_refused_naming_both() -> None:
    app = App("svc")
    app.rabbitmq(queue="a", consumer="payments")(handle)
    with pytest.raises(ConfigurationError) as raised:
        app.kafka(topics=["b"], consumer="payments")(other)
    said = str(raised.value)
    assert "two parts named 'payments'" in said and "test_declarations.handle" in said
    assert "give each its own name" in said
    assert app.part_names == ["payments"]


def test_a_relay_or_pruner_named_like_a_consumer_is_refused() -> None:
    app = App("svc")
    app.rabbitmq(queue="a", consumer="relay")(handle)
    with pytest.raises(ConfigurationError, match="two parts named 'relay'"):
        app.relay(to="kafka")
    app.relay(to="kafka", name="outbox")
    with pytest.raises(ConfigurationError, match="a relay already"):
        app.relay(to="kafka", name="outbox-2")


@pytest.mark.parametrize(
    "declare",
    [
        lambda app: app.consumer(consumer="c"),
        lambda app: app.consumer(consumer="c", topics=["t"], queue="q"),
        lambda app: app.kafka(topics=[], consumer="c"),
        lambda app: app.kafka(consumer="c"),
        lambda app: app.rabbitmq(consumer="c"),
        lambda app: app.rabbitmq(queue="", consumer="c"),
    ],
)
def test_a_handler_bound_to_no_source_is_refused(declare: Any) -> None:
    with pytest.raises(ConfigurationError) as raised:
        declare(App("svc"))(handle)
    said = str(raised.value)
    assert "'c'" in said or "topics" in said or "queue" in said


def test_no_source_says_how_to_give_one() -> None:
    with pytest.raises(ConfigurationError, match=r"no source: give topics=\[\.\.\.\] \(Kafka\)"):
        App("svc").consumer(consumer="c")


def test_the_decorator_without_its_arguments_is_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"without its arguments: write @app.consumer"):
        App("svc").consumer(handle)


@pytest.mark.parametrize(
    ("fn", "said"),
    [
        (
            lambda message: None,
            r"takes \(message\): a consumer's handler takes \(message, session\)",
        ),
        (lambda m, s, extra: None, "give the others defaults"),
        (lambda: None, "add the missing parameter"),
    ],
)
def test_a_handler_with_the_wrong_signature_is_refused(fn: Any, said: str) -> None:
    with pytest.raises(ConfigurationError, match=said) as raised:
        App("svc").rabbitmq(queue="q", consumer="c")(fn)
    assert "consumer 'c'" in str(raised.value)


def test_a_bulk_handler_is_told_its_shape() -> None:
    with pytest.raises(ConfigurationError, match=r"takes \(messages, session\)"):
        App("svc").kafka(topics="t", consumer="c", bulk=True)(lambda messages: None)


def test_a_typed_list_on_a_per_message_consumer_is_refused() -> None:
    def takes_many(payments: list[Payment], session: Any) -> None:
        pass

    def takes_one(payment: Payment, session: Any) -> None:
        pass

    with pytest.raises(ConfigurationError, match="declare it with bulk=True"):
        App("svc").kafka(topics="t", consumer="c")(takes_many)
    with pytest.raises(ConfigurationError, match=r"annotate it as list\[\.\.\.\]"):
        App("svc").kafka(topics="t", consumer="c", bulk=True)(takes_one)


def test_an_unknown_option_names_it_and_the_known_ones() -> None:
    with pytest.raises(ConfigurationError) as raised:
        App("svc").rabbitmq(queue="q", consumer="c", batchsize=10)(handle)
    said = str(raised.value)
    assert "'batchsize'" in said and "batch_size" in said


def test_runner_options_are_checked_by_the_runners_config_at_declaration() -> None:
    with pytest.raises(ConfigurationError, match="batch_size"):
        App("svc").rabbitmq(queue="q", consumer="c", batch_size=0)(handle)
    with pytest.raises(ConfigurationError, match="partitions_in_flight"):
        App("svc").kafka(topics="t", consumer="c", partitions_in_flight=0)(handle)


def test_a_config_and_its_fields_together_are_refused() -> None:
    from consumerdedup.adapters.kafka import KafkaConfig

    with pytest.raises(ConfigurationError, match="not both"):
        App("svc").kafka(topics="t", consumer="c", config=KafkaConfig(), batch_size=3)(handle)


def test_a_str_of_topics_is_one_topic() -> None:
    app = App("svc")
    app.kafka(topics="orders", consumer="c")(handle)
    assert app.consumers["c"].sources == ("orders",)


def test_a_handler_wrapped_already_must_keep_its_consumer(sqlite_db: Database) -> None:
    dedup = Deduplicator(sqlite_db.engine, consumer="payments", tables=sqlite_db.tables)
    wrapped = dedup.handler(handle)
    with pytest.raises(ConfigurationError, match="declare it with consumer='payments'"):
        App("svc").rabbitmq(queue="q", consumer="other")(wrapped)
    app = App("svc")
    app.rabbitmq(queue="q", consumer="payments")(wrapped)
    assert app.consumers["payments"].wrapped


def test_the_pruner_and_only_are_checked() -> None:
    app = App("svc")
    with pytest.raises(ConfigurationError, match="pruner"):
        app.pruner(every=3600)  # type: ignore[arg-type]
    app.pruner(every=timedelta(hours=1), retention=timedelta(days=7))
    with pytest.raises(
        ConfigurationError, match=r"no part named 'nope' in app 'svc' \(its parts: pruner\)"
    ):
        app.build(only=["nope"])


def test_no_database_is_said_when_a_part_needs_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONSUMERDEDUP_DATABASE_URL", raising=False)
    monkeypatch.delenv("CONSUMERDEDUP_DB_URL", raising=False)
    app = App("svc")
    app.rabbitmq(queue="q", consumer="c")(handle)
    with pytest.raises(ConfigurationError, match="set CONSUMERDEDUP_DATABASE_URL"):
        app.build()


def test_a_consumer_without_a_name_is_told_why_it_needs_one() -> None:
    with pytest.raises(ConfigurationError, match="needs consumer='name'"):
        App("svc").rabbitmq(queue="q")
