"""Round-3 attack on the RabbitMQ adapter through its public API: what a fresh look found."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from consumerdedup import ConfigurationError, Deduplicator
from consumerdedup.adapters.rabbitmq import (
    RabbitConsumerRunner,
    RabbitPublisher,
)
from tests.cli.test_relay import relay_command
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

SECRET = "Se"
"""The part of each password below that a URL parser takes for something else."""
MISREAD = [
    f"amqp://guest:{SECRET}/cr3t@127.0.0.1:5672/%2F",
    f"amqp://guest:{SECRET}#cr3t@127.0.0.1:5672/%2F",
    f"amqp://guest:{SECRET}?cr3t@127.0.0.1:5672/%2F",
]


@pytest.mark.parametrize("url", MISREAD)
def test_a_password_the_url_parser_misreads_is_not_echoed_in_the_error(db: Any, url: str) -> None:
    """A password with an unescaped / # or ? ends the authority early: the parser reads its
    first part as the port and said so ("Port could not be cast to integer value as 'Se'"),
    printing the start of the password in the ConfigurationError."""
    handler = Deduplicator(db.engine, consumer="c", tables=db.tables).handler(lambda m, s: None)
    for make in (
        lambda: RabbitPublisher(url),
        lambda: RabbitConsumerRunner(handler, "q", url=url),
    ):
        with pytest.raises(ConfigurationError) as caught:
            make()
        message = str(caught.value)
        assert f"'{SECRET}'" not in message and "cr3t" not in message, message
        assert "percent-encode" in message, message


def test_the_relay_command_does_not_echo_a_misread_password(db: Any) -> None:
    done = subprocess.run(
        relay_command(db, "--rabbitmq", MISREAD[0], "--once"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert f"'{SECRET}'" not in done.stdout + done.stderr, done.stderr
