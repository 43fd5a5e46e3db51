"""Errors that say what to fix (issue 23 item 5), against the real services.

Each message the newcomer met, now naming the object and the fix and nothing secret:
a wrong database, role or port; a refused broker login (RabbitMQ ACCESS_REFUSED, a Kafka
SASL refusal); ``relay --once`` failing when the broker is away or nothing went out; a bad
address a usage error (exit 2) before anything runs.
"""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from typing import Any

import pika  # type: ignore[import-untyped]
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from consumerdedup import AuthenticationFailed, ConfigurationError, Deduplicator, Message, Outbox
from consumerdedup.cli.main import error_line
from consumerdedup.reasons import authentication_refused
from tests.cli.test_commands import cli
from tests.cli.test_relay import relay_command
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401

PASSWORD = "Wr0ng-Pw-7431"
CLOSED = 1  # nothing listens on port 1


def add(db: Any, destination: str, count: int) -> None:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        for n in range(count):
            outbox.add(session, destination, f"e{n}".encode(), key="k")


def relay_once(db: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        relay_command(db, "--once", *args), capture_output=True, text=True, timeout=120
    )


def wrong_password(amqp_url: str) -> str:
    params = pika.URLParameters(amqp_url)
    return f"amqp://guest:{PASSWORD}@{params.host}:{params.port}/%2F"


# --- the database ---------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("wrong", ["database", "role", "port"])
def test_a_wrong_database_role_or_port_says_which_and_what_to_check(
    postgres_url: str, wrong: str
) -> None:
    url = make_url(postgres_url).set(drivername="postgresql", password=PASSWORD)
    url, said = {
        "database": (url.set(database="no_such_db"), 'database "no_such_db" does not exist'),
        "role": (url.set(username="no_such_role"), 'role "no_such_role" does not exist'),
        "port": (url.set(port=CLOSED), f"port {CLOSED} failed: Connection refused"),
    }[wrong]
    run = cli("stats", "--db", url.render_as_string(hide_password=False))
    run.assert_one_line_error(1, PASSWORD)
    assert ("AuthenticationFailed" in run.err) is (wrong == "role"), run.err
    assert said in run.err and f'"{url.host}"' in run.err, run.err
    fix = {"database": "check the database name", "role": "check the user (role)"}
    assert fix.get(wrong, f"check the host and port in the URL ({url.host}:{CLOSED})") in run.err


@pytest.mark.postgres
def test_a_role_that_may_not_log_in_is_authentication_failed(postgres_url: str) -> None:
    role = f"cdd_nologin_{uuid.uuid4().hex[:8]}"
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE ROLE {role} NOLOGIN")
    try:
        url = make_url(postgres_url).set(drivername="postgresql", username=role)
        run = cli("stats", "--db", url.set(password=PASSWORD).render_as_string(False))
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP ROLE {role}")
        engine.dispose()
    run.assert_one_line_error(1, PASSWORD)
    assert run.err.startswith("consumerdedup: error: AuthenticationFailed: "), run.err
    assert f'role "{role}" is not permitted to log in: grant that role LOGIN' in run.err


def test_a_refused_database_password_is_authentication_failed() -> None:
    """The server here trusts every local login, so its 28P01 cannot be produced: libpq's own
    words for it (as psycopg raises them at connect) are classified instead."""
    text = (
        'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
        'FATAL:  password authentication failed for user "alice"'
    )
    error = OperationalError(None, None, psycopg.OperationalError(text))
    assert authentication_refused(error)
    line = error_line(error)
    assert line.startswith("AuthenticationFailed: OperationalError: ") and PASSWORD not in line
    assert 'user "alice": check that user\'s password in the URL' in line, line
    assert not authentication_refused(OperationalError(None, None, psycopg.OperationalError("x")))


@pytest.mark.parametrize(
    "url, said",
    [
        ("postgresql://alice@127.0.0.1:99999/db", "port must be 1 to 65535"),
        (f"postgresql://alice:p@{PASSWORD}@127.0.0.1/db", "percent-encode"),
        ("sqlite://relative.db", "invalid database URL"),
        ("postgresql//127.0.0.1/db", "could not parse the database URL"),
    ],
)
def test_a_malformed_database_url_is_a_usage_error(url: str, said: str) -> None:
    run = cli("stats", "--db", url)
    run.assert_one_line_error(2, PASSWORD)
    assert said in run.err, run.err


@pytest.mark.parametrize(
    "broker",
    [
        ["--rabbitmq", "http://127.0.0.1:5672/"],
        ["--rabbitmq", f"amqp://guest:{PASSWORD}@127.0.0.1:notaport/%2F"],
        ["--kafka", "127.0.0.1:99999"],
        ["--kafka", "kafka://127.0.0.1:9092"],
    ],
)
def test_a_malformed_broker_address_is_a_usage_error_before_the_database(
    broker: list[str],
) -> None:
    run = cli("relay", "--once", "--db", "postgresql://nobody@127.0.0.1:1/never", *broker)
    run.assert_one_line_error(2, PASSWORD)
    assert "Connection refused" not in run.err  # said before the database is tried


# --- relay --once ---------------------------------------------------------------------


def test_relay_once_with_a_wrong_rabbitmq_password_is_authentication_failed(
    sqlite_db: Any, amqp_url: str
) -> None:
    add(sqlite_db, "q", 3)
    done = relay_once(sqlite_db, "--rabbitmq", wrong_password(amqp_url))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("consumerdedup: error: AuthenticationFailed")
    assert "ACCESS_REFUSED" in lines[0] and "check the user and password" in lines[0]
    assert PASSWORD not in done.stdout + done.stderr


def test_relay_once_with_the_broker_unreachable_exits_1(sqlite_db: Any) -> None:
    add(sqlite_db, "t", 3)
    done = relay_once(sqlite_db, "--kafka", f"127.0.0.1:{CLOSED}")
    assert done.returncode == 1, done.stderr
    assert "published 0 event(s); 3 waiting" in done.stdout
    assert f"Kafka at 127.0.0.1:{CLOSED} could not be reached; 3 event(s) waiting" in done.stderr


def test_relay_once_exits_1_when_events_waited_and_none_went_out(
    sqlite_db: Any, amqp_url: str
) -> None:
    add(sqlite_db, "cdd-no-such-queue", 3)  # unroutable: no queue is bound for it
    done = relay_once(sqlite_db, "--rabbitmq", amqp_url)
    assert done.returncode == 1, done.stderr
    assert "published 0 event(s); 3 waiting" in done.stdout
    assert "3 event(s) waiting and none published" in done.stderr


def test_relay_once_with_nothing_to_do_exits_0(sqlite_db: Any, amqp_url: str) -> None:
    done = relay_once(sqlite_db, "--rabbitmq", amqp_url)
    assert done.returncode == 0, done.stderr
    assert "published 0 event(s); 0 waiting" in done.stdout


# --- the runners ----------------------------------------------------------------------


def handler(db: Any) -> Any:
    dedup = Deduplicator(db.engine, "c", tables=db.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        pass

    return handle


def test_a_rabbitmq_runner_with_a_wrong_password_stops_with_authentication_failed(
    sqlite_db: Any, amqp_url: str
) -> None:
    from consumerdedup.adapters.rabbitmq import RabbitConsumerRunner

    runner = RabbitConsumerRunner(handler(sqlite_db), "q", url=wrong_password(amqp_url))
    with pytest.raises(AuthenticationFailed, match="ACCESS_REFUSED") as refused:
        runner.run(until_idle=True)
    assert isinstance(refused.value, ConfigurationError)
    assert PASSWORD not in str(refused.value)


SASL = {
    "security_protocol": "SASL_PLAINTEXT",
    "sasl_mechanism": "PLAIN",
    "sasl_plain_username": "alice",
    "sasl_plain_password": PASSWORD,
}


def test_a_kafka_sasl_refusal_is_authentication_failed_for_publisher_and_runner(
    kafka: KafkaService, sqlite_db: Any
) -> None:
    """Tansu speaks no SASL: its refusal is UnsupportedSaslMechanismError, which aiokafka
    only logs before raising "Unable to bootstrap" (BrokerUnavailable, retried forever).
    A wrong password on a SASL broker (SaslAuthenticationFailed) is the same path; not
    tested here, no such broker."""
    from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner, KafkaPublisher

    async def publish() -> None:
        publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=False, options=SASL)
        try:
            await publisher.publish("t", b"x")
        finally:
            await publisher.stop()

    with pytest.raises(AuthenticationFailed, match="sasl_plain_password") as refused:
        asyncio.run(asyncio.wait_for(publish(), 60))
    assert PASSWORD not in str(refused.value)
    config = KafkaConfig(
        consumer_options={**kafka.group_options, **SASL},
        producer_options=SASL,
        idempotent_producer=False,
    )
    runner = KafkaConsumerRunner(
        handler(sqlite_db), "t", bootstrap_servers=kafka.bootstrap, config=config
    )
    with pytest.raises(AuthenticationFailed, match="refused the credentials"):
        asyncio.run(asyncio.wait_for(runner.run(until_idle=True), 60))
