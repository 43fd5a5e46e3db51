"""Issue 17 on Kafka: no record's conversion stops its partition, a dead letter that can never
be sent does not hold it, and a producer that cannot start is the runner's fault, said at run()."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from consumerdedup import Message
from consumerdedup.adapters.kafka import KafkaConfig
from consumerdedup.adapters.kafka.convert import dead_letter_headers, to_message
from tests.kafka.test_runner import Ledger, body, runner
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
