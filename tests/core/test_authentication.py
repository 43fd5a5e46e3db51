"""A refused database login stops the deduplicators and the runners (issue 23 item 5).

A role that does not exist, or may not log in, is SQLSTATE class 28: retrying cannot fix
it. It used to be a transient fault, so a runner with a wrong role logged ``consuming``
and held every message back for ever; now the first transaction raises
AuthenticationFailed (a ConfigurationError) naming the role and the fix, no message is
recorded or dead-lettered, and the broker keeps every message. Real PostgreSQL, real
RabbitMQ.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import AsyncDeduplicator, AuthenticationFailed, Deduplicator, Message
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

pytestmark = pytest.mark.postgres
PASSWORD = "pw-9312-never-shown"


@pytest.fixture(params=["missing", "nologin"])
def refused_url(request: pytest.FixtureRequest, postgres_url: str) -> Iterator[str]:
    """A URL whose role the server refuses: one that does not exist, or one without LOGIN."""
    role = f"cdd_auth_{uuid.uuid4().hex[:8]}"
    admin = create_engine(postgres_url)
    if request.param == "nologin":
        with admin.begin() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {role} NOLOGIN")
    url = make_url(postgres_url).set(username=role, password=PASSWORD)
    yield url.render_as_string(hide_password=False)
    if request.param == "nologin":
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP ROLE {role}")
    admin.dispose()


def message(n: int = 1) -> Message:
    return Message(id=f"m-{n}", body=b"{}", source="orders")


def assert_refused(error: AuthenticationFailed) -> None:
    text = str(error)
    assert 'role "cdd_auth_' in text and PASSWORD not in text, text
    assert "check the user (role) in the URL" in text or "grant that role LOGIN" in text, text


def test_the_deduplicator_raises_authentication_failed(refused_url: str) -> None:
    engine = create_engine(refused_url)
    dedup = Deduplicator(engine, "c")
    ran: list[Message] = []

    @dedup.handler
    def handle(m: Message, session: Session) -> None:
        ran.append(m)

    with pytest.raises(AuthenticationFailed) as refused:
        handle.process(message())
    engine.dispose()
    assert_refused(refused.value)
    assert ran == []


def test_the_async_deduplicator_raises_authentication_failed(refused_url: str) -> None:
    async_url = make_url(refused_url).set(drivername="postgresql+psycopg")
    engine = create_async_engine(async_url)
    dedup = AsyncDeduplicator(engine, "c")

    @dedup.handler
    async def handle(m: Message, session: Any) -> None:
        raise AssertionError("never called")

    async def process() -> None:
        try:
            await handle.process(message())
        finally:
            await engine.dispose()

    with pytest.raises(AuthenticationFailed) as refused:
        asyncio.run(process())
    assert_refused(refused.value)


def test_a_rabbitmq_runner_stops_and_the_broker_keeps_every_message(
    refused_url: str, rabbit: Broker, amqp_url: str
) -> None:
    from consumerdedup.adapters.rabbitmq import RabbitConsumerRunner

    queue = rabbit.queue("auth")
    for n in range(3):
        rabbit.publish(queue, b"{}", f"m-{n}")
    engine = create_engine(refused_url)
    dedup = Deduplicator(engine, "c")

    @dedup.handler
    def handle(m: Message, session: Session) -> None:
        raise AssertionError("never called")

    runner = RabbitConsumerRunner(handle, queue, url=amqp_url)
    try:
        with pytest.raises(AuthenticationFailed) as refused:
            runner.run(until_idle=True)
    finally:
        engine.dispose()
    assert_refused(refused.value)
    assert rabbit.held(queue) == 3  # nothing acked, nothing dead-lettered
    assert rabbit.ready(queue + ".dlq") == 0
