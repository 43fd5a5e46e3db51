"""Issue 17 on Kafka: no record's conversion stops its partition, a dead letter that can never
be sent does not hold it, and a producer that cannot start is the runner's fault, said at run()."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.errors import ClusterAuthorizationFailedError, TopicAuthorizationFailedError
from aiokafka.structs import ConsumerRecord
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import select
from sqlalchemy.orm import Session

from consumerdedup import (
    ConfigurationError,
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
)
from consumerdedup.adapters.kafka import (
    BODY_DROPPED_HEADER,
    BrokerRefused,
    KafkaConfig,
    KafkaConsumerRunner,
    KafkaPublisher,
)
from consumerdedup.adapters.kafka.convert import dead_letter_headers, to_message
from consumerdedup.headers import ID_HEADER, REASON_HEADER
from tests.kafka.test_runner import FAST, Ledger, body, runner
from tests.support.kafka_doubles import grants_idempotence
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ANYTHING = st.one_of(st.none(), st.binary(max_size=20), st.text(max_size=10), INT64, st.floats())


@pytest.fixture(name="ledger")
async def ledger_fixture(pg: Any) -> Any:
    ledger = Ledger(pg)
    yield ledger
    await ledger.close()


def record(**fields: Any) -> ConsumerRecord:
    values: dict[str, Any] = {
        "topic": "t",
        "partition": 0,
        "offset": 7,
        "timestamp": 0,
        "timestamp_type": 0,
        "key": None,
        "value": b"{}",
        "checksum": None,
        "serialized_key_size": -1,
        "serialized_value_size": 2,
        "headers": [],
    }
    values.update(fields)
    return ConsumerRecord(**values)


RECORDS = st.builds(
    record,
    topic=st.one_of(st.text(min_size=1, max_size=30), ANYTHING),
    partition=st.one_of(st.integers(0, 2**31 - 1), ANYTHING),
    offset=st.one_of(st.integers(0, 2**63 - 1), ANYTHING),
    timestamp=st.one_of(INT64, ANYTHING),
    key=ANYTHING,
    value=st.one_of(st.binary(max_size=50), ANYTHING),
    headers=st.one_of(
        st.lists(st.tuples(st.one_of(st.sampled_from(["event_id", "x"]), ANYTHING), ANYTHING)),
        ANYTHING,
    ),
)
CONFIGS = st.sampled_from(
    [KafkaConfig(), KafkaConfig(coordinates_as_id=False), KafkaConfig(key=lambda m: m.body[0:1])]
)


@settings(max_examples=400, deadline=None)
@given(RECORDS, CONFIGS)
def test_no_record_makes_the_conversion_raise(found: ConsumerRecord, config: KafkaConfig) -> None:
    """Whatever a field holds, the conversion answers a Message and maybe a refusal, and the
    dead-letter headers of that record can be built: nothing raises out of the runner."""
    message, refusal = to_message(found, config)
    assert isinstance(message, Message) and message.raw is found
    assert refusal is None or isinstance(refusal, str)
    if refusal is None and isinstance(found.timestamp, int) and found.timestamp >= 0:
        assert message.timestamp is None or message.timestamp.year >= 1970
    headers = dead_letter_headers(found, refusal or "failed", "c")
    assert all(isinstance(n, str) and isinstance(v, bytes) for n, v in headers)


def test_a_timestamp_python_cannot_hold_is_no_time_not_an_error() -> None:
    for stamp in (10**17, 2**63 - 1):
        message, refusal = to_message(
            record(timestamp=stamp, headers=[("event_id", b"a")]), KafkaConfig()
        )
        assert (message.id, message.timestamp, refusal) == ("a", None, None)
    message, refusal = to_message(record(headers=[("event_id", 5)]), KafkaConfig())
    assert refusal is not None and refusal.startswith("the record cannot be read: TypeError")


async def test_a_record_with_a_far_future_timestamp_does_not_stop_its_partition(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """timestamp_ms=10**17 is a valid CreateTime Python's datetime cannot hold: it used to
    raise in the conversion of the whole chunk, so run() died before the healthy record in
    front of it was handled, on every restart. Each record is applied, the offset moves on."""
    topic = await topics.create("far-future")
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all")
    await producer.start()
    try:
        for n, stamp in ((1, None), (2, 10**17), (3, None)):
            await producer.send_and_wait(
                topic, body(n), timestamp_ms=stamp, headers=[("event_id", f"m-{n}".encode())]
            )
    finally:
        await producer.stop()
    group = "group-" + topic
    await runner(kafka, ledger.handle, topic, group_id=group).run(until_idle=True)
    assert ledger.applied() == ["m-1", "m-2", "m-3"]
    assert await topics.committed(group, topic) == {0: 3}
    assert await topics.records(topic + ".dlq") == []


# -- item 8: a dead letter that can never be sent ---------------------------------------------


async def test_a_dead_letter_too_large_to_send_goes_without_its_value(
    kafka: KafkaService, topics: Topics, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    """The dead-letter producer's max_request_size is below the FAILED record's size: aiokafka
    raises MessageSizeTooLargeError (not retriable) at every try, and the partition used to be
    read again from that record forever. The copy goes without its value, saying why."""
    topic = await topics.create("too-large")
    await topics.produce(topic, body(1), event_id="m-1")
    await topics.produce(topic, body(2, fail="poison", pad="x" * 5000), event_id="m-2")
    await topics.produce(topic, body(3), event_id="m-3")
    group = "group-" + topic
    small = runner(kafka, ledger.handle, topic, producer_options={"max_request_size": 2000})
    await asyncio.wait_for(small.run(until_idle=True), 60)
    assert ledger.applied() == ["m-1", "m-3"]
    assert await topics.committed(group, topic) == {0: 3}
    [dead] = await topics.records(topic + ".dlq")
    headers = dict(dead.headers)
    assert dead.value == b"" and headers[ID_HEADER] == b"m-2"
    assert headers[REASON_HEADER] == b"PermanentError: poison"
    assert b"MessageSizeTooLargeError" in headers[BODY_DROPPED_HEADER]
    assert small.outcomes[Outcome.FAILED] == 1
    assert any(
        r.levelname == "ERROR" and "without its value" in r.getMessage() for r in caplog.records
    )


async def test_a_dead_letter_topic_we_may_not_write_does_not_hold_the_partition(
    kafka: KafkaService,
    topics: Topics,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TopicAuthorizationFailedError (Tansu has no ACLs: a double raising aiokafka's own error
    for the copy, the copy without value and the bare copy): the loss is logged at ERROR, the
    FAILED record is kept, the partition goes on. A retriable error still holds it (test_runner)."""
    double = grants_idempotence(monkeypatch, [("send", TopicAuthorizationFailedError())] * 3)
    topic = await topics.create("no-acl")
    for n in (1, 2, 3):
        await topics.produce(topic, body(n, fail="poison" if n == 2 else None), event_id=f"m-{n}")
    options = {**FAST, "consumer_options": kafka.group_options}
    denied = KafkaConsumerRunner(
        ledger.handle, topic, bootstrap_servers=kafka.bootstrap, config=KafkaConfig(**options)
    )
    await asyncio.wait_for(denied.run(until_idle=True), 60)
    assert double.script == [] and double.sent == []
    assert ledger.applied() == ["m-1", "m-3"] and "m-2" in ledger.recorded()
    assert await topics.committed(denied.group_id, topic) == {0: 3}
    [lost] = [r for r in caplog.records if "not even without its value" in r.getMessage()]
    assert lost.levelname == "ERROR" and "TopicAuthorizationFailedError" in lost.getMessage()


# -- item 10: a producer that cannot start is a setup fault, said at run() --------------------


async def test_a_dead_letter_producer_the_broker_refuses_stops_run_before_any_record(
    kafka: KafkaService, topics: Topics, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """IdempotentWrite not granted at InitProducerId (a double raising aiokafka's error at
    start): run() raises a ConfigurationError naming idempotent_producer=False before any
    record is handled, instead of holding the partition at the first dead letter."""
    grants_idempotence(monkeypatch, [("start", ClusterAuthorizationFailedError())])
    topic = await topics.create("init-refused")
    await topics.produce(topic, body(1), event_id="m-1")
    options = {**FAST, "consumer_options": kafka.group_options}
    refused = KafkaConsumerRunner(
        ledger.handle, topic, bootstrap_servers=kafka.bootstrap, config=KafkaConfig(**options)
    )
    with pytest.raises(BrokerRefused, match=r"KafkaConfig\(idempotent_producer=False\)"):
        await asyncio.wait_for(refused.run(until_idle=True), 60)
    assert isinstance(BrokerRefused("x"), ConfigurationError)
    assert ledger.applied() == [] and ledger.recorded() == set()
    assert await topics.committed(refused.group_id, topic) == {0: 0}


@pytest.mark.parametrize(
    "address",
    ["amqp://host:5672/", "host:notaport", "host:99999", "", "user:secret@host:9092", ["a:1", 2]],
)
def test_a_bootstrap_address_that_cannot_work_is_refused_at_construction(
    address: Any, sqlite_db: Any
) -> None:
    handler = Deduplicator(sqlite_db.engine, consumer="c").handler(lambda m, s: None)
    for make in (
        lambda: KafkaPublisher(address),
        lambda: KafkaConsumerRunner(handler, "t", bootstrap_servers=address),
    ):
        with pytest.raises(ConfigurationError, match="host:port") as refused:
            make()
        assert "secret" not in str(refused.value)
    KafkaPublisher("localhost, [::1]:9092,kafka-0.kafka:9093")  # what aiokafka takes


def test_the_relay_charges_no_event_for_a_producer_the_broker_refuses(
    kafka: KafkaService, pg: Any
) -> None:
    """KafkaPublisher with idempotence (the default) on Tansu, which refuses InitProducerId:
    the relay used to charge "cannot start the Kafka producer" to every event and park them.
    Now run_once and run raise a ConfigurationError naming --no-idempotence, and no event
    has an attempt charged; with enable_idempotence=False every event goes."""
    if kafka.idempotence:
        pytest.skip("this broker grants idempotent producers: nothing is refused")
    topic = f"cdd-relay-idem-{uuid.uuid4().hex[:8]}"
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session, session.begin():
        for n in range(3):
            outbox.add(session, topic, f"e{n}".encode(), key="k")
    for step in ("run_once", "run"):
        relay = OutboxRelay(pg.engine, KafkaPublisher(kafka.bootstrap), tables=pg.tables)
        with pytest.raises(ConfigurationError, match="--no-idempotence"):
            getattr(relay, step)()
        relay.close()
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        assert conn.execute(select(ob.c.attempts, ob.c.last_error)).all() == [(0, None)] * 3
    publisher = KafkaPublisher(kafka.bootstrap, enable_idempotence=False)
    with OutboxRelay(pg.engine, publisher, tables=pg.tables) as relay:
        assert relay.drain() == 3
