"""Round 10, fresh eyes on issue 32 and 38 through the App and `consumerdedup run`: what a
service module or its environment gives, checked where it is given.

Seen failing before the fixes:
- two consumers of one RabbitMQ queue, or of one Kafka topic in one group, under two names
  were accepted: the broker shares the messages between them, so a redelivery (a crash
  between COMMIT and the ack, a rebalance) reaching the other one finds no record under its
  name and is applied a second time;
- a database URL that does not parse (CONSUMERDEDUP_DATABASE_URL or App(database_url=))
  was accepted and stopped the worker later with a bare "ArgumentError" and exit 1; a
  password with a bare '@' was cut there by the URL parser, and the rest of it, taken for
  the host, was printed by --check ("cannot resolve the host 'tail@127.0.0.1'"), and by the
  worker's logs and /readyz.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from consumerdedup import App, ConfigurationError, Message
from consumerdedup.app import Settings
from consumerdedup.cli.main import main

LEDGER = "tests.worker.ledger_service:app"


def handler(message: Message, session: Any) -> None:
    """A consumer's handler; never called here."""


def test_two_consumers_of_one_queue_are_refused() -> None:
    app = App("shop")
    app.rabbitmq(queue="payments", consumer="payments")(handler)
    with pytest.raises(ConfigurationError) as refused:
        app.rabbitmq(queue="payments", consumer="payments-v2")(handler)
    said = str(refused.value)
    assert "'payments'" in said and "'payments-v2'" in said and "queue 'payments'" in said
    assert app.part_names == ["payments"]


def test_a_kafka_topic_twice_in_one_group_is_refused_in_another_group_accepted() -> None:
    app = App("shop")
    app.kafka(topics=["orders", "returns"], consumer="orders")(handler)
    with pytest.raises(ConfigurationError, match="topic 'returns' in Kafka group 'orders'"):
        app.kafka(topics="returns", consumer="returns", group_id="orders")(handler)
    with pytest.raises(ConfigurationError, match="topic 'orders' in Kafka group 'shared'"):
        app.kafka(topics="orders", consumer="audit", group_id="shared")(handler)
        app.kafka(topics="orders", consumer="audit-v2", group_id="shared")(handler)
    # A group of its own reads every record itself: its records under its own name.
    app.kafka(topics="orders", consumer="reporting")(handler)
    assert app.part_names == ["orders", "audit", "reporting"]


def test_the_same_name_for_queue_and_topic_is_two_sources() -> None:
    app = App("shop")
    app.rabbitmq(queue="payments", consumer="payments")(handler)
    app.kafka(topics="payments", consumer="payments-stream")(handler)
    assert app.part_names == ["payments", "payments-stream"]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    import os

    for name in list(os.environ):
        if name.startswith("CONSUMERDEDUP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("CONSUMERDEDUP_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
    yield monkeypatch


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        code = main(["run", *args])
    except SystemExit as exited:
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgresql//app:s3cr3t-head@127.0.0.1/test", "does not parse"),
        ("postgresql://app:s3cr3t-head@127.0.0.1:54x32/test", "does not parse"),
        ("postgrsql://app:s3cr3t-head@127.0.0.1/test", "knows no database 'postgrsql'"),
        ("postgresql://app:s3cr3t-head@pw-tail@127.0.0.1/test", "'@' in the password"),
        ("", "does not parse"),
    ],
)
def test_a_database_url_that_cannot_be_used_is_a_usage_error_that_shows_none_of_it(
    capsys: pytest.CaptureFixture[str], clean_env: pytest.MonkeyPatch, url: str, said: str
) -> None:
    clean_env.setenv("CONSUMERDEDUP_DATABASE_URL", url)
    code, printed = run(capsys, LEDGER, "--check")
    assert "s3cr3t-head" not in printed and "pw-tail" not in printed, printed
    assert code == 2, printed
    assert "CONSUMERDEDUP_DATABASE_URL" in printed and said in printed
    assert "Traceback" not in printed


def test_app_database_url_is_checked_where_given() -> None:
    with pytest.raises(ConfigurationError) as refused:
        App("shop", database_url="postgresql://app:s3cr3t-head@pw-tail@db/shop")
    assert "App(database_url)" in str(refused.value) and "percent-encoded" in str(refused.value)
    assert "s3cr3t-head" not in str(refused.value) and "pw-tail" not in str(refused.value)
    with pytest.raises(ConfigurationError, match=r"App\(database_url\)"):
        App("shop", database_url="not a url")
    App("shop", database_url="postgresql://app:s3cr3t%40pw@db/shop")  # encoded: fine


def test_settings_load_checks_a_database_url_given_in_code() -> None:
    with pytest.raises(ConfigurationError) as refused:
        Settings.load(database_url="postgresql://app:s3cr3t-head@pw-tail@db/shop")
    assert "database_url" in str(refused.value) and "pw-tail" not in str(refused.value)
    assert Settings.load(database_url="sqlite://").secret("database_url") == "sqlite://"
