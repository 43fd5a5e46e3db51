"""Issue 17 on RabbitMQ: no delivery's conversion stops the queue, a dead letter that can never
be sent does not hold it, and a publisher that cannot start is the relay's fault."""

from __future__ import annotations

import calendar
import datetime as dt
import decimal
import time
from typing import Any

import pika
import pika.spec
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from consumerdedup import Message
from consumerdedup.adapters.rabbitmq import RabbitConfig
from consumerdedup.adapters.rabbitmq.convert import Delivery, dead_letter_properties, to_message
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
