"""A passive declare that the broker closes with anything but 404 NOT_FOUND says nothing of
whether the queue exists (real RabbitMQ). The retention read (``prune --rabbitmq``, the
App's pruner window) took every channel close for "the queue does not exist"; now only
404 does, and another reply (405 RESOURCE_LOCKED: a queue exclusive to another connection;
403 ACCESS_REFUSED) is a RabbitError naming the queue, the reply and the fix. Callers see
a broker error, not a missing queue: ``prune`` exits 1 (not a usage error), App.check
FAILs the consumer and the window as "cannot ask/read the broker" and does not fall back
to ``pruner(retention=...)``."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pika
import pika.exceptions
import pytest

from consumerdedup import App, ConfigurationError
from consumerdedup.adapters.rabbitmq.errors import RabbitError
from consumerdedup.adapters.rabbitmq.retention import rabbitmq_retention
from consumerdedup.adapters.rabbitmq.topology import missing_queues, refused
from consumerdedup.app import Settings
from consumerdedup.startup import FAIL
from tests.cli.test_prune import ages, fill, prune
from tests.conftest import Database
from tests.support import services
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401

LOCKED = "405 RESOURCE_LOCKED"


@pytest.fixture
def locked(amqp_url: str) -> Iterator[str]:
    """A queue exclusive to another connection (held open by the test): it exists, and a
    passive declare from any other connection is closed with 405 RESOURCE_LOCKED."""
    owner = pika.BlockingConnection(pika.URLParameters(amqp_url))
    name = f"cdd-locked-{uuid.uuid4().hex[:10]}"
    owner.channel().queue_declare(name, exclusive=True)  # gone with its connection
    yield name
    owner.close()


def test_the_retention_read_says_refused_not_missing(amqp_url: str, locked: str) -> None:
    with pytest.raises(RabbitError) as raised:
        rabbitmq_retention(amqp_url, [locked])
    assert not isinstance(raised.value, ConfigurationError)
    said = str(raised.value)
    assert locked in said and LOCKED in said and "exclusive to another connection" in said
    assert "do not exist" not in said
    with pytest.raises(RabbitError, match=LOCKED):  # App.check's consumer line asks this
        missing_queues([locked], url=amqp_url)


def test_prune_exits_on_a_broker_error_not_a_missing_queue(
    sqlite_db: Database, amqp_url: str, locked: str
) -> None:
    fill(sqlite_db)
    run = prune(sqlite_db, "--rabbitmq", amqp_url, "--queues", locked, "--consumer", "ledger")
    assert run.code == 1, (run.code, run.err)
    assert locked in run.err and LOCKED in run.err and "do not exist" not in run.err
    assert ages(sqlite_db, "ledger") == set(range(30))  # nothing pruned


def test_app_check_fails_on_the_broker_and_does_not_fall_back(
    sqlite_db: Database, amqp_url: str, locked: str
) -> None:
    app = App(f"locked-{uuid.uuid4().hex[:8]}", database_url=sqlite_db.url, tables=sqlite_db.tables)
    app.rabbitmq(queue=locked, consumer="c")(lambda message, session: None)
    app.pruner(every=timedelta(hours=1), retention=timedelta(days=3))
    found = {c.name: c for c in app.check(Settings.load(rabbitmq_url=amqp_url))}
    consumer, window = found["consumer c"], found["window c"]
    assert consumer.status == FAIL and LOCKED in consumer.detail, consumer
    assert "missing queue" not in consumer.detail
    assert window.status == FAIL and LOCKED in window.detail, window  # not retention=3d
    assert "do not exist" not in window.detail and "credentials" in (window.fix or "")


def test_access_refused_names_the_users_rights() -> None:
    """RabbitMQ (3.x) checks no rights on a passive declare (below), so a 403 there comes
    from brokers that do: its error names the user, the vhost and set_permissions."""
    params = pika.URLParameters("amqp://reader:secret@127.0.0.1:5672/shop")
    error = refused("orders", params, pika.exceptions.ChannelClosedByBroker(403, "ACCESS_REFUSED"))
    said = str(error)
    assert "'orders'" in said and "403 ACCESS_REFUSED" in said and "secret" not in said
    assert "rabbitmqctl set_permissions -p shop reader" in said


def ctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args, "--quiet"], check=True, capture_output=True, timeout=60)


def test_a_user_without_rights_still_gets_the_right_answer(amqp_url: str) -> None:
    """A user with no configure/write/read rights in the vhost: RabbitMQ answers its
    passive declares (an existing queue exists, a missing one is 404), so neither is read
    wrongly."""
    services.tool("rabbitmqctl", "a user with restricted rights is made with rabbitmqctl")
    params = pika.URLParameters(amqp_url)
    if params.host not in ("127.0.0.1", "localhost"):
        services.unavailable("rabbitmqctl manages the local broker only")
    user, password = f"cdd-user-{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    admin = pika.BlockingConnection(params)
    existing, absent = (f"cdd-rights-{uuid.uuid4().hex[:10]}" for _ in range(2))
    admin.channel().queue_declare(existing)
    ctl("add_user", user, password)
    try:
        ctl("set_permissions", "-p", params.virtual_host, user, "^$", "^$", "^$")
        host, port, vhost = params.host, params.port, params.virtual_host.replace("/", "%2F")
        url = f"amqp://{user}:{password}@{host}:{port}/{vhost}"
        assert missing_queues([existing, absent], url=url) == [absent]
    finally:
        ctl("delete_user", user)
        admin.channel().queue_delete(existing)
        admin.close()
