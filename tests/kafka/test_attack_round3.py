"""Round-3 attack on the Kafka adapter through its public API: what a fresh look found."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiokafka.producer.message_accumulator as accumulator
import aiokafka.producer.producer as producing
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import _DefaultRecordBatchBuilderPy

from consumerdedup import ConfigurationError, Deduplicator
from consumerdedup.adapters.kafka import (
    BODY_DROPPED_HEADER,
    OFFSET_HEADER,
    KafkaConsumerRunner,
    KafkaPublisher,
)
from consumerdedup.headers import ID_HEADER, REASON_HEADER
from tests.kafka.test_runner import Ledger, body, runner
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)


@pytest.fixture(name="ledger")
async def ledger_fixture(pg: Any) -> Any:
    ledger = Ledger(pg)
    yield ledger
    await ledger.close()


class NotUtf8(str):
    """A header key that goes on the wire as bytes that are not UTF-8 (as a client in another
    language may send: Kafka header keys are strings, the broker does not check them)."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"\xff\xfekey"


@pytest.fixture(name="raw_header_keys")
def raw_header_keys_fixture() -> Iterator[None]:
    """aiokafka's pure-Python batch builder, which encodes header keys with ``str.encode``
    (the C one takes only exact str): so a test producer can send a NotUtf8 key."""
    saved = accumulator.DefaultRecordBatchBuilder, producing.DefaultRecordBatchBuilder
    accumulator.DefaultRecordBatchBuilder = _DefaultRecordBatchBuilderPy
    producing.DefaultRecordBatchBuilder = _DefaultRecordBatchBuilderPy
    try:
        yield
    finally:
        accumulator.DefaultRecordBatchBuilder, producing.DefaultRecordBatchBuilder = saved


def ids(*names: str) -> list[tuple[str, bytes]]:
    return [("event_id", name.encode()) for name in names]


async def test_a_record_whose_header_key_is_not_utf8_does_not_stop_the_runner(
    kafka: KafkaService, topics: Topics, ledger: Ledger, raw_header_keys: None
) -> None:
    """aiokafka raises UnicodeDecodeError out of getmany for such a record: run() died there,
    before the healthy records in front of it, on every restart (all partitions stopped).
    Now: every readable record is applied once, on every partition; the undecodable record
    and the rest of its batch (aiokafka cannot read past it) are dead-lettered with the
    reason; the offsets reach the end, so the next record of that partition is applied."""
    topic = await topics.create("bad-header-key", partitions=3)
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all", linger_ms=200)
    await producer.start()
    try:
        for p in (0, 2):
            await producer.send_and_wait(topic, body(1), partition=p, headers=ids(f"p{p}-a"))
        # One batch on partition 1: a readable record, the undecodable one, a readable one.
        sent = [
            await producer.send(topic, body(1), partition=1, headers=ids("p1-a")),
            await producer.send(
                topic, body(1), partition=1, headers=[(NotUtf8("k"), b"v"), *ids("p1-bad")]
            ),
            await producer.send(topic, body(1), partition=1, headers=ids("p1-c")),
        ]
        offsets = [(await future).offset for future in sent]
        assert offsets == [0, 1, 2]
        for p in (0, 1, 2):
            await producer.send_and_wait(topic, body(1), partition=p, headers=ids(f"p{p}-z"))
    finally:
        await producer.stop()
    group = "group-" + topic
    await asyncio.wait_for(
        runner(kafka, ledger.handle, topic, group_id=group).run(until_idle=True), 60
    )
    applied = ledger.applied()
    assert sorted(applied) == ["p0-a", "p0-z", "p1-a", "p1-z", "p2-a", "p2-z"], applied
    assert applied.index("p1-a") < applied.index("p1-z")
    assert await topics.committed(group, topic) == {0: 2, 1: 4, 2: 2}
    dead = await topics.records(topic + ".dlq")
    assert [dict(r.headers)[OFFSET_HEADER] for r in dead] == [b"1", b"2"]
    reasons = [dict(r.headers)[REASON_HEADER].decode() for r in dead]
    assert "UnicodeDecodeError" in reasons[0] and "offset 1" in reasons[1], reasons


@pytest.mark.parametrize("bulk", ["key", "header"])
async def test_a_dead_letter_whose_key_or_headers_are_too_large_still_goes(
    kafka: KafkaService, topics: Topics, ledger: Ledger, bulk: str
) -> None:
    """The copy without its value kept the record's key and headers: when they are what the
    broker refuses (a 3 kB key or header over a max_request_size of 2,000), that copy was
    refused too and the dead letter was lost (logged, not sent). The last copy now goes bare:
    no value, no key, no original header but the id, saying why."""
    topic = await topics.create("bulky-" + bulk)
    fat = b"k" * 3000
    await topics.produce(topic, body(1), event_id="m-1")
    if bulk == "key":
        await topics.produce(topic, body(2, fail="poison"), event_id="m-2", key=fat)
    else:
        await topics.produce(topic, body(2, fail="poison"), event_id="m-2", headers=[("t", fat)])
    await topics.produce(topic, body(3), event_id="m-3")
    group = "group-" + topic
    small = runner(kafka, ledger.handle, topic, producer_options={"max_request_size": 2000})
    await asyncio.wait_for(small.run(until_idle=True), 60)
    assert ledger.applied() == ["m-1", "m-3"]
    assert await topics.committed(group, topic) == {0: 3}
    dead = await topics.records(topic + ".dlq")
    assert len(dead) == 1, "the dead letter was not sent"
    headers = dict(dead[0].headers)
    assert (dead[0].value, dead[0].key, headers.get("t")) == (b"", None, None)
    assert headers[ID_HEADER] == b"m-2" and headers[REASON_HEADER] == b"PermanentError: poison"
    assert b"MessageSizeTooLargeError" in headers[BODY_DROPPED_HEADER]


@pytest.mark.parametrize(
    "address",
    [
        "localhost:9092:1",
        "[::1",
        "[::1:9092",
        "[host]:9092",
        "a b:9092",
        "host:\uff19\uff10\uff19\uff12",
    ],
)
def test_a_bootstrap_address_aiokafka_misreads_is_refused_at_construction(
    address: str, sqlite_db: Any
) -> None:
    """Accepted before: aiokafka then read 'localhost:9092:1' as host 'localhost:9092' port 1
    and '[::1' raised ValueError at start (BrokerUnavailable retried forever, or a raw error),
    i.e. charged to the run, not said at construction."""
    handler = Deduplicator(sqlite_db.engine, consumer="c").handler(lambda m, s: None)
    for make in (
        lambda: KafkaPublisher(address),
        lambda: KafkaConsumerRunner(handler, "t", bootstrap_servers=address),
    ):
        with pytest.raises(ConfigurationError, match="host:port"):
            make()
    KafkaPublisher("::1, [::1]:9092, 10.0.0.1:9092, kafka_0.internal:9093")  # all fine
