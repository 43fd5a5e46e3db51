"""Round-3 attack on the RabbitMQ adapter through its public API: what a fresh look found."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pika
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Deduplicator, Outbox, OutboxRelay
from consumerdedup.adapters.rabbitmq import (
    BODY_DROPPED_HEADER,
    BrokerUnavailable,
    RabbitConfig,
    RabbitConsumerRunner,
    RabbitPublisher,
)
from tests.cli.test_relay import relay_command
from tests.rabbitmq.test_round3 import run_until_settled
from tests.rabbitmq.test_runner import Consumer, body, dead_letters
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


@pytest.fixture(name="silent_port")
def silent_port_fixture() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word (not an AMQP broker; a
    broker too busy to answer looks the same)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()


def test_a_port_that_never_answers_the_handshake_is_broker_unavailable(
    db: Any, silent_port: int
) -> None:
    """pika raised its own AMQPConnectorStackTimeout (not an AMQPConnectionError) out of
    RabbitPublisher and RabbitConsumerRunner: not one of our errors, never retried, and the
    relay stopped on it as if the setup were wrong. Now it is BrokerUnavailable (transient:
    the relay backs off and charges nothing), saying to check the port is AMQP's."""
    url = f"amqp://guest:guest@127.0.0.1:{silent_port}/%2F"
    options = {"stack_timeout": 0.3}
    publisher = RabbitPublisher(
        url, connect_timeout=timedelta(milliseconds=500), connection_options=options
    )
    with pytest.raises(BrokerUnavailable) as caught:
        publisher.__enter__()
    assert "AMQP" in str(caught.value) and "guest" not in str(caught.value)
    handler = Deduplicator(db.engine, consumer="c", tables=db.tables).handler(lambda m, s: None)
    config = RabbitConfig(reconnect_timeout=timedelta(milliseconds=500), connection_options=options)
    with pytest.raises(BrokerUnavailable):
        RabbitConsumerRunner(handler, "q", url=url, config=config).run()
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        outbox.add(session, "q", b"{}", key="k")
    with OutboxRelay(db.engine, publisher, tables=db.tables) as relay:
        assert relay.run_once() == 0  # backed off: the broker is away, nothing charged
    with db.engine.connect() as conn:
        attempts = conn.execute(select(db.tables.outbox.c.attempts)).scalars().all()
    assert attempts == [0]


def test_a_message_published_with_another_users_user_id_is_dead_lettered(
    db: Any, rabbit: Broker
) -> None:
    """RabbitMQ checks the user_id property against the publishing connection's user. The
    dead-letter copy kept the original's: a message another user had published with its own
    user_id (valid when it was sent) was refused on the runner's connection (406
    PRECONDITION_FAILED), with and without its body, so it was never dead-lettered."""
    queue = rabbit.queue()
    user = rabbit.name("user")
    ctl = ["rabbitmqctl", "--quiet"]
    subprocess.run([*ctl, "add_user", user, "pw"], check=True, capture_output=True, timeout=60)
    try:
        subprocess.run(
            [*ctl, "set_permissions", "-p", "/", user, ".*", ".*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        params = pika.URLParameters(rabbit.url)
        other = pika.BlockingConnection(
            pika.URLParameters(f"amqp://{user}:pw@{params.host}:{params.port}/%2F")
        )
        try:
            channel = other.channel()
            channel.confirm_delivery()
            for n, refuse in ((1, None), (2, "poison"), (3, None)):
                properties = pika.BasicProperties(message_id=f"m-{n}", user_id=user)
                channel.basic_publish("", queue, body(n=n, refuse=refuse), properties)
        finally:
            other.close()
        consumer = Consumer(db, rabbit, queue)
        run_until_settled(consumer, rabbit, queue, 2)
    finally:
        subprocess.run([*ctl, "delete_user", user], capture_output=True, timeout=60)
    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    [(props, content)] = dead_letters(rabbit, queue)
    assert (props.message_id, content) == ("m-2", body(n=2, refuse="poison"))
    assert props.headers["x-dead-letter-reason"] == "PermanentError: poison"


def test_a_dead_letter_whose_headers_outgrow_the_frame_does_not_hold_the_queue(
    db: Any, rabbit: Broker
) -> None:
    """A message whose headers nearly fill a frame (the broker's frame_max, 128 kB) fits; its
    dead-letter copy, with our reason headers added, does not: RabbitMQ closed the whole
    connection (501 FRAME_ERROR), the runner reconnected, the message came back with its
    batch-mates unacked, and so on forever (29 reconnects in 15 s, nothing acked). Now a copy
    over the frame is refused before it is sent, and a bare copy (no body, only our headers)
    goes, saying why; the queue moves on."""
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    lean = pika.BasicProperties(message_id="m-2", delivery_mode=2, headers={"fat": ""})
    room = 131_072 - 20 - len(b"".join(lean.encode()))  # the whole frame, less what is there
    fat = "v" * (room - 40)  # fits; our reason, consumer and source headers will not
    rabbit.publish(queue, body(refuse="poison"), "m-2", headers={"fat": fat})
    rabbit.publish(queue, body(n=3), "m-3")
    consumer = Consumer(db, rabbit, queue)
    run_until_settled(consumer, rabbit, queue, 2)
    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    assert consumer.runner.reconnects == 0
    [(props, content)] = dead_letters(rabbit, queue)
    assert (props.message_id, content, props.headers.get("fat")) == ("m-2", b"", None)
    assert props.headers["x-dead-letter-reason"] == "PermanentError: poison"
    assert "frame" in props.headers[BODY_DROPPED_HEADER]


def test_an_outbox_event_whose_headers_outgrow_the_frame_fails_alone(
    db: Any, rabbit: Broker, amqp_url: str
) -> None:
    """An event added with headers over the frame size: RabbitMQ closed the relay's whole
    connection (501 FRAME_ERROR), RabbitPublisher took it for an outage (BrokerUnavailable),
    so the relay charged nothing and ended every round there: no event behind it, of any
    key, was ever published again. Now the publisher refuses that event before sending
    (PublishRefused): it is charged and holds back only its own key."""
    queue = rabbit.queue()
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        outbox.add(session, queue, b"a", key="a")
        outbox.add(session, queue, b"fat", key="f", headers={"h": "v" * 140_000})
        outbox.add(session, queue, b"b", key="b")
    with OutboxRelay(db.engine, RabbitPublisher(amqp_url), tables=db.tables) as relay:
        assert relay.run_once() == 2
    assert sorted(content for _, content in rabbit.peek(queue)) == [b"a", b"b"]
    with db.engine.connect() as conn:
        [(attempts, error)] = conn.execute(
            select(db.tables.outbox.c.attempts, db.tables.outbox.c.last_error).where(
                db.tables.outbox.c.published_at.is_(None)
            )
        ).all()
    assert attempts == 1 and "frame" in error, error


def test_the_relay_command_says_refused_credentials_in_one_line(db: Any, amqp_url: str) -> None:
    """pika logs the refused handshake at ERROR with a traceback ('Error in
    _create_connection()'); the command printed five driver lines and that traceback before
    its own line. Without --verbose: one line, exit 1, no password, no event charged."""
    params = pika.URLParameters(amqp_url)
    url = f"amqp://guest:Wr0ng-Pw@{params.host}:{params.port}/%2F"
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        outbox.add(session, "q", b"{}", key="k")
    done = subprocess.run(
        relay_command(db, "--rabbitmq", url, "--once"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "AuthenticationFailed" in lines[0], done.stderr  # a BrokerRefused
    assert "Wr0ng-Pw" not in done.stdout + done.stderr
    with db.engine.connect() as conn:
        assert conn.execute(select(db.tables.outbox.c.attempts)).scalars().all() == [0]
