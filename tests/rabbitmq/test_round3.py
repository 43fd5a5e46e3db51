"""Issue 17 on RabbitMQ: no delivery's conversion stops the queue, a dead letter that can never
be sent does not hold it, and a publisher that cannot start is the relay's fault."""

from __future__ import annotations

import calendar
import datetime as dt
import decimal
import subprocess
import time
from typing import Any

import pika
import pika.exceptions
import pika.spec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pika.adapters.blocking_connection import BlockingChannel
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Message, Outbox, OutboxRelay, Outcome
from consumerdedup.adapters.rabbitmq import (
    BODY_DROPPED_HEADER,
    BrokerRefused,
    RabbitConfig,
    RabbitConsumerRunner,
    RabbitPublisher,
)
from consumerdedup.adapters.rabbitmq.convert import Delivery, dead_letter_properties, to_message
from tests.cli.test_relay import relay_command
from tests.rabbitmq.test_runner import Consumer, body, dead_letters
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

SHORT = st.one_of(st.text(max_size=20), st.binary(max_size=20))
FIELD_VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
        st.decimals(
            allow_nan=False, allow_infinity=False, places=2, max_value=10**6, min_value=-(10**6)
        ),
        st.datetimes(timezones=st.just(dt.UTC)),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
PROPERTIES = st.builds(
    pika.BasicProperties,
    content_type=st.one_of(st.none(), SHORT),
    content_encoding=st.one_of(st.none(), SHORT),
    headers=st.one_of(
        st.none(), st.dictionaries(st.sampled_from(["event_id", "x", "y"]), FIELD_VALUES)
    ),
    delivery_mode=st.one_of(st.none(), st.integers(0, 255)),
    priority=st.one_of(st.none(), st.integers(0, 255)),
    correlation_id=st.one_of(st.none(), SHORT),
    reply_to=st.one_of(st.none(), SHORT),
    expiration=st.one_of(st.none(), st.text(max_size=10)),
    message_id=st.one_of(st.none(), SHORT),
    timestamp=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    type=st.one_of(st.none(), SHORT),
    user_id=st.one_of(st.none(), SHORT),
    app_id=st.one_of(st.none(), SHORT),
)
CONFIGS = st.sampled_from(
    [RabbitConfig(), RabbitConfig(key=lambda m: m.json()["id"]), RabbitConfig(id_header="y")]
)


def wire(properties: Any) -> Any:
    """``properties`` as a consumer reads them: encoded by pika, then decoded by pika."""
    encoded = b"".join(properties.encode())
    decoded = pika.spec.BasicProperties()
    decoded.decode(encoded)
    return decoded


def delivery(properties: Any, content: bytes = b"{}") -> Delivery:
    method = pika.spec.Basic.Deliver(delivery_tag=1, routing_key="q", exchange="")
    return Delivery(method, properties, content)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(PROPERTIES, st.binary(max_size=30), CONFIGS)
def test_no_delivery_makes_the_conversion_raise(props: Any, content: bytes, config: Any) -> None:
    """Every property as it can come off the wire: the conversion answers a Message and maybe
    a refusal, and the dead-letter copy's properties can be built and encoded again."""
    try:
        received = wire(props)
    except Exception:  # pika cannot send these at all (a short string over 255 bytes...)
        assume(False)
    found = delivery(received, content)
    message, refusal = to_message(found, "q", config)
    assert isinstance(message, Message) and message.raw is found
    assert refusal is None or isinstance(refusal, str)
    b"".join(dead_letter_properties(found, refusal or "failed", "c", "q").encode())


def test_a_delivery_whose_properties_cannot_be_read_is_refused_not_raised() -> None:
    odd = pika.BasicProperties(headers=["not", "a", "table"], message_id="m")  # type: ignore[arg-type]
    message, refusal = to_message(delivery(odd), "q", RabbitConfig())
    assert message.id is None and message.source == "q"
    assert refusal is not None and refusal.startswith("the delivery cannot be read: TypeError")
    copy = dead_letter_properties(delivery(odd), refusal, "c", "q")
    assert copy.headers["x-dead-letter-reason"] == refusal


class FarFuture(dt.datetime):
    """A header timestamp past year 9999: any uint64 is a valid AMQP timestamp field."""

    def utctimetuple(self) -> Any:
        return (9999, 1, 10**12, 0, 0, 0, 0, 1, 0)  # what calendar.timegm adds up


def test_a_header_timestamp_python_cannot_hold_does_not_stop_the_queue(
    db: Any, rabbit: Broker
) -> None:
    """pika decoded such a header into a datetime while reading the frame, raised, and lost
    the connection: the message came back at every reconnect and nothing behind it moved.
    Every message is applied, the far-future field kept as the number of seconds sent."""
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(n=2), "m-2", headers={"sent": FarFuture(2020, 1, 1)})
    rabbit.publish(queue, body(n=3), "m-3", timestamp=2**64 - 1)
    rabbit.publish(queue, body(n=4), "m-4", headers={"money": decimal.Decimal("1.50")})
    consumer = Consumer(db, rabbit, queue)
    stop = consumer.start()
    try:
        deadline = time.monotonic() + 20
        while len(consumer.applied()) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop()
    assert sorted(consumer.applied()) == ["m-1", "m-2", "m-3", "m-4"], (
        f"{consumer.runner.reconnects} reconnects"
    )
    assert consumer.runner.reconnects == 0
    [second] = [m for m in consumer.seen if m.id == "m-2"]
    assert second.headers["sent"] == str(calendar.timegm(FarFuture(2020, 1, 1).utctimetuple()))
    assert rabbit.held(queue) == 0 and dead_letters(rabbit, queue) == []


# -- item 8: a dead letter that can never be sent ---------------------------------------------


def run_until_settled(consumer: Consumer, rabbit: Broker, queue: str, applied: int) -> None:
    """Run the consumer in a thread until ``applied`` messages are applied and the queue is
    empty; fail within 20 s, saying where it stood (a message held forever never settles)."""
    stop = consumer.start()
    try:
        deadline = time.monotonic() + 20
        while len(consumer.applied()) < applied or rabbit.ready(queue) > 0:
            assert time.monotonic() < deadline, (
                f"not settled: applied {consumer.applied()}, {rabbit.ready(queue)} ready, "
                f"{consumer.runner.outcomes}"
            )
            time.sleep(0.05)
    finally:
        stop()
    failed = consumer.runner.outcomes[Outcome.FAILED]
    assert failed == 1, f"the refused message came back {failed - 1} time(s): it was held"
    assert rabbit.held(queue) == 0


def test_a_dead_letter_over_the_brokers_size_limit_goes_without_its_body(
    db: Any, rabbit: Broker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """RabbitMQ closes the channel with 406 PRECONDITION_FAILED for a message over its
    max_message_size (a broker-wide setting, so a double raises pika's own error for copies
    over 1,000 bytes). The copy used to be given back and retried forever; now a copy without
    the body goes, for real, saying why, and the queue moves on."""
    queue = rabbit.queue()
    rabbit.publish(queue, body(n=1), "m-1")
    rabbit.publish(queue, body(refuse="poison", pad="x" * 5000), "m-2", headers={"trace": "t"})
    rabbit.publish(queue, body(n=3), "m-3")
    real = BlockingChannel.basic_publish

    def limited(self: Any, exchange: str, routing_key: str, body: bytes, *a: Any, **k: Any) -> Any:
        if len(body) > 1000:
            raise pika.exceptions.ChannelClosedByBroker(
                406,
                f"PRECONDITION_FAILED - message size {len(body)} is larger than "
                "configured max size 1000",
            )
        return real(self, exchange, routing_key, body, *a, **k)

    monkeypatch.setattr(BlockingChannel, "basic_publish", limited)
    consumer = Consumer(db, rabbit, queue)
    run_until_settled(consumer, rabbit, queue, 2)
    monkeypatch.undo()
    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    [(props, content)] = dead_letters(rabbit, queue)
    assert content == b"" and props.message_id == "m-2" and props.headers["trace"] == "t"
    assert props.headers["x-dead-letter-reason"] == "PermanentError: poison"
    assert "PRECONDITION_FAILED" in props.headers[BODY_DROPPED_HEADER]
    assert any(
        r.levelname == "ERROR" and "without its body" in r.getMessage() for r in caplog.records
    )


def test_a_dead_letter_exchange_we_may_not_write_does_not_hold_the_queue(
    db: Any, rabbit: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A real refusal: the runner's user has no write permission on the dead-letter exchange
    (rabbitmqctl set_permissions), so the broker answers 403 ACCESS_REFUSED to the copy and to
    the copy without body. The loss is logged at ERROR, the FAILED record is kept, the message
    is acked and the queue moves on (it used to be given back and retried forever)."""
    queue = rabbit.queue()
    exchange = rabbit.name("deny")
    rabbit.channel.exchange_declare(exchange, exchange_type="direct", durable=True)
    rabbit.channel.queue_bind(queue + ".dlq", exchange, routing_key=queue + ".dlq")
    user = rabbit.name("user")
    ctl = ["rabbitmqctl", "--quiet"]
    subprocess.run([*ctl, "add_user", user, "pw"], check=True, capture_output=True, timeout=60)
    try:
        subprocess.run(
            [*ctl, "set_permissions", "-p", "/", user, ".*", f"^(?!{exchange}$).*", ".*"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        rabbit.publish(queue, body(n=1), "m-1")
        rabbit.publish(queue, body(refuse="poison"), "m-2")
        rabbit.publish(queue, body(n=3), "m-3")
        consumer = Consumer(db, rabbit, queue)
        params = pika.URLParameters(rabbit.url)
        url = f"amqp://{user}:pw@{params.host}:{params.port}/%2F"
        config = RabbitConfig(
            idle_timeout=dt.timedelta(milliseconds=300),
            retry_delay=dt.timedelta(0),
            dead_letter_exchange=exchange,
        )
        consumer.runner = RabbitConsumerRunner(
            consumer.runner.handler, queue, url=url, config=config
        )
        run_until_settled(consumer, rabbit, queue, 2)
    finally:
        subprocess.run([*ctl, "delete_user", user], capture_output=True, timeout=60)
    assert sorted(consumer.applied()) == ["m-1", "m-3"]
    assert dead_letters(rabbit, queue) == []
    [lost] = [r for r in caplog.records if "not even without its body" in r.getMessage()]
    assert lost.levelname == "ERROR" and "ACCESS_REFUSED" in lost.getMessage()
    with db.engine.connect() as conn:
        outcome = conn.execute(
            text(f"SELECT outcome FROM {db.name('processed_events')} WHERE message_id = 'm-2'")
        ).scalar()
    assert outcome == "failed"


# -- item 10: a publisher that cannot start is the relay's fault ------------------------------


def test_a_relay_whose_rabbitmq_refuses_its_credentials_stops_and_charges_no_event(
    db: Any, amqp_url: str
) -> None:
    """Wrong credentials used to read as BrokerUnavailable: the relay backed off and tried
    again forever. Now RabbitPublisher connects when the relay enters it, and the refusal
    (BrokerRefused, a ConfigurationError) stops run_once and run; no event is charged."""
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        outbox.add(session, "orders", b"e", key="k")
    params = pika.URLParameters(amqp_url)
    url = f"amqp://nobody:wrong@{params.host}:{params.port}/%2F"
    for step in ("run_once", "run"):
        relay = OutboxRelay(db.engine, RabbitPublisher(url), tables=db.tables)
        with pytest.raises(BrokerRefused, match="refused the credentials") as refused:
            getattr(relay, step)()
        relay.close()
        assert isinstance(refused.value, ConfigurationError)
        assert "wrong" not in str(refused.value)
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        assert conn.execute(select(ob.c.attempts, ob.c.last_error)).all() == [(0, None)]


def test_a_rabbitmq_url_that_is_not_amqp_is_refused_at_construction() -> None:
    for url in ("localhost:9092", "http://guest:secret@host:15672/", "kafka://host:9092"):
        with pytest.raises(ConfigurationError, match="amqp://") as refused:
            RabbitPublisher(url)
        assert "secret" not in str(refused.value)


@pytest.mark.parametrize(
    ("option", "address"),
    [("--kafka", "amqp://guest:secret@host:5672/"), ("--rabbitmq", "host:9092")],
)
def test_the_relay_command_refuses_an_address_for_the_other_broker(
    db: Any, option: str, address: str
) -> None:
    """``consumerdedup relay --kafka amqp://host:5672/`` used to charge 'invalid literal for
    int()' to each event and park them: now one line naming the option, exit 2, no event
    charged (and the address's password is not printed)."""
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        outbox.add(session, "orders", b"e", key="k")
    done = subprocess.run(
        relay_command(db, option, address, "--once", "--no-idempotence"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"consumerdedup: error: {option}:") and "secret" not in line
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        assert conn.execute(select(ob.c.attempts)).scalars().all() == [0]


def test_both_adapters_name_the_new_routes_alike() -> None:
    """Twins: the same header on a dead letter sent without its body, the same error names
    for a refusal for good and for a broker that will not let the client start."""
    from consumerdedup.adapters import kafka, rabbitmq

    assert kafka.BODY_DROPPED_HEADER == rabbitmq.BODY_DROPPED_HEADER
    for adapter in (kafka, rabbitmq):
        assert issubclass(adapter.BrokerRefused, ConfigurationError)
        assert not issubclass(adapter.BrokerRefused, ConnectionError)  # never retried
        assert issubclass(adapter.PublishRefused, adapter.PublishFailed)
        assert {"BODY_DROPPED_HEADER", "BrokerRefused", "PublishRefused"} <= set(adapter.__all__)
