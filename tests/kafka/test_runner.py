"""KafkaConsumerRunner on the real broker and PostgreSQL: ids, bad input, dead letters, retries."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka.errors import (
    NotEnoughReplicasError,
    OutOfOrderSequenceNumber,
    UnknownProducerId,
)
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from consumerdedup import (
    AsyncDeduplicator,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.adapters.kafka import (
    OFFSET_HEADER,
    PARTITION_HEADER,
    SOURCE_HEADER,
    KafkaConfig,
    KafkaConsumerRunner,
)
from consumerdedup.headers import CONSUMER_HEADER, ID_HEADER, REASON_HEADER
from tests.core.test_lifecycle import MARGIN
from tests.support.kafka_doubles import grants_idempotence
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    refusing_broker,
    topics_fixture,
)

QUICK_RETRY = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))
FAST = {"poll_timeout": timedelta(milliseconds=100), "retry_delay": timedelta(0)}
CLOSE = 0.2
"""Seconds for the consumer to leave its group and close once the loop has ended."""


def body(n: int = 1, **controls: Any) -> bytes:
    return json.dumps({"n": n, **controls}).encode()


class Ledger:
    """A business table and an AsyncDeduplicator handler that writes one row per message."""

    def __init__(self, pg: Any, **options: Any) -> None:
        self.pg = pg
        self.table = pg.create_ledger()
        with pg.engine.begin() as conn:  # insertion order, to check commit order
            conn.exec_driver_sql(f"ALTER TABLE {self.table} ADD COLUMN seq SERIAL")
        self.engine: AsyncEngine = pg.async_engine()
        options.setdefault("retry", QUICK_RETRY)
        self.dedup = AsyncDeduplicator(self.engine, consumer="ledger", tables=pg.tables, **options)
        self.before: Callable[[Message], Awaitable[None]] | None = None

        @self.dedup.handler
        async def handle(message: Message, session: Any) -> None:
            data = message.json()
            if self.before is not None:
                await self.before(message)
            if data.get("fail"):
                raise PermanentError(data["fail"])
            await session.execute(
                text(
                    f"INSERT INTO {self.table} (account, amount, message_id) VALUES ('a', :n, :m)"
                ),
                {"n": data["n"], "m": message.id},
            )

        self.handle = handle

    def applied(self) -> list[str]:
        """Message ids in the order their rows were inserted."""
        with self.pg.engine.connect() as conn:
            rows = conn.exec_driver_sql(f"SELECT message_id FROM {self.table} ORDER BY seq")
            return [r[0] for r in rows]

    def recorded(self) -> set[str]:
        with self.pg.engine.connect() as conn:
            rows = conn.exec_driver_sql(
                f"SELECT message_id FROM {self.pg.name('processed_events')}"
            )
            return {r[0] for r in rows}

    async def close(self) -> None:
        await self.engine.dispose()


@pytest.fixture
async def ledger(pg: Any) -> Any:
    ledger = Ledger(pg)
    yield ledger
    await ledger.close()


def runner(kafka: KafkaService, handler: Any, topic: str, **config: Any) -> KafkaConsumerRunner:
    before_ack = config.pop("before_ack", None)
    return KafkaConsumerRunner(
        handler,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=config.pop("group_id", "group-" + topic),
        config=kafka.config(**{**FAST, **config}),
        before_ack=before_ack,
    )


async def wait_for(
    condition: Callable[[], Awaitable[bool]], what: str, timeout: float = 60
) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def headers_of(record: Any) -> dict[str, bytes]:
    return dict(record.headers)


async def test_the_id_is_the_header_else_the_key_function_else_the_coordinates(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("ids")
    await topics.produce(topic, body(), event_id="from-header", key=b"ignored")
    await topics.produce(topic, body(), key=b"from-key")
    await topics.produce(topic, body())  # no header, no key: its coordinates

    def key(message: Message) -> str | None:
        return message.raw.key.decode() if message.raw.key else None

    await runner(kafka, ledger.handle, topic, key=key).run(until_idle=True)
    assert sorted(ledger.applied()) == sorted(["from-header", "from-key", f"{topic}:0:2"])
    assert await topics.lag("group-" + topic, topic) == 0


async def test_without_coordinates_a_record_without_id_is_dead_lettered(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("noid")
    await topics.produce(topic, body())
    await topics.produce(topic, body(), event_id="e-2")
    await runner(kafka, ledger.handle, topic, coordinates_as_id=False).run(until_idle=True)
    assert ledger.applied() == ["e-2"]
    [dead] = await topics.records(topic + ".dlq")
    assert b"no message id: no 'event_id' header" in headers_of(dead)[REASON_HEADER]


async def test_bad_records_are_dead_lettered_with_their_reason_and_the_rest_go_on(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("bad")
    trace = [("trace", b"t-1")]
    await topics.produce(topic, body(1), event_id="ok-1")
    await topics.produce(topic, None, event_id="tombstone", key=b"k")
    await topics.produce(topic, body(3), event_id=b"\xff\xfe", headers=trace)
    await topics.produce(topic, body(4), event_id="")
    await topics.produce(topic, body(5), event_id="x" * 300)
    await topics.produce(topic, b"\x00 not json", event_id="garbled")
    await topics.produce(topic, body(7), key=b"boom")
    await topics.produce(topic, body(8), event_id="ok-8")

    def key(message: Message) -> str | None:
        raise ValueError("cannot read the key")

    await runner(kafka, ledger.handle, topic, key=key, batch_size=3).run(until_idle=True)

    assert sorted(ledger.applied()) == ["ok-1", "ok-8"]
    dead = await topics.records(topic + ".dlq")
    reasons = [headers_of(r)[REASON_HEADER].decode() for r in dead]
    expected = [
        "InvalidMessage: the record has a null value (a tombstone)",
        "InvalidMessage: the 'event_id' header is not valid UTF-8",
        "InvalidMessage: message id is empty",
        "InvalidMessage: message id is 300 characters long",
        "DecodeError: body is not valid JSON",
        "InvalidMessage: no message id: no 'event_id' header, and the key function raised "
        "ValueError: cannot read the key",
    ]
    assert len(reasons) == len(expected), reasons
    for reason, start in zip(reasons, expected, strict=True):
        assert reason.startswith(start), reason
    # The dead letter is the original record plus why, who and where from.
    utf8 = dead[1]
    assert utf8.value == body(3)
    assert headers_of(utf8)[ID_HEADER] == b"\xff\xfe"
    assert headers_of(utf8)["trace"] == b"t-1"
    assert headers_of(utf8)[CONSUMER_HEADER] == b"ledger"
    assert headers_of(utf8)[SOURCE_HEADER] == topic.encode()
    assert headers_of(utf8)[PARTITION_HEADER] == b"0"
    assert headers_of(utf8)[OFFSET_HEADER] == b"2"
    assert dead[0].key == b"k" and dead[0].value == b""
    assert await topics.lag("group-" + topic, topic) == 0


async def test_a_poison_record_mid_partition_is_dead_lettered_and_the_rest_processed(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("poison")
    ids = [f"m-{i:02d}" for i in range(40)]
    await topics.produce_many(
        topic, [(mid, body(i, fail="poison" if i == 17 else None)) for i, mid in enumerate(ids)]
    )
    run = runner(kafka, ledger.handle, topic, batch_size=10)
    await run.run(until_idle=True)

    assert sorted(ledger.applied()) == [mid for mid in ids if mid != "m-17"]
    [dead] = await topics.records(topic + ".dlq")
    assert headers_of(dead)[ID_HEADER] == b"m-17"
    assert headers_of(dead)[REASON_HEADER] == b"PermanentError: poison"
    assert run.outcomes[Outcome.FAILED] == 1 and run.outcomes[Outcome.PROCESSED] == 39
    assert await topics.committed("group-" + topic, topic) == {0: 40}


async def test_a_retry_holds_the_offset_at_that_record_and_nothing_behind_it_is_skipped(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("retry")
    ids = [f"m-{i}" for i in range(10)]
    await topics.produce_many(topic, [(mid, body(i)) for i, mid in enumerate(ids)])
    group = "group-" + topic
    ready = asyncio.Event()
    refusals = 0

    async def before(message: Message) -> None:
        nonlocal refusals
        if message.id == "m-3" and not ready.is_set():
            refusals += 1
            raise RetryLater("not yet")

    ledger.before = before
    pause = timedelta(milliseconds=200)
    run = runner(kafka, ledger.handle, topic, retry_delay=pause, max_retry_delay=pause)
    task = asyncio.create_task(run.run(until_idle=True))
    # Nothing behind m-3 commits before it: the offset and the effects stop at m-3.
    # 6 reads 0.2 s apart: 15 s is ample, and a pause never lifted fails in 15 s, not 60.
    await wait_for(lambda: _true(refusals >= 6), "m-3 to be read again a few times", 15)
    assert ledger.applied() == ids[:3]
    assert await topics.committed(group, topic) == {0: 3}
    ready.set()
    await wait_for(lambda: _true(task.done()), "run(until_idle=True) to end after m-3", 30)
    await task

    assert ledger.applied() == ids  # in offset order
    assert await topics.committed(group, topic) == {0: 10}
    assert run.outcomes[Outcome.RETRY] >= 3 * 7  # m-3 and the six behind it, per pass
    assert run.outcomes[Outcome.DUPLICATE] == 0  # nothing behind m-3 had committed
    assert run.outcomes[Outcome.PROCESSED] == 10


async def test_a_retry_that_recovers_in_process_keeps_offset_order(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    three = RetryPolicy(attempts=3, initial_delay=timedelta(0), max_delay=timedelta(0))
    ledger = Ledger(pg, retry=three)
    topic = await topics.create("recover")
    ids = [f"r-{i}" for i in range(1, 6)]
    await topics.produce_many(topic, [(mid, body(i)) for i, mid in enumerate(ids)])
    tries = 0

    async def before(message: Message) -> None:
        nonlocal tries
        if message.id == "r-2" and tries < 2:
            tries += 1
            raise RetryLater("twice")

    ledger.before = before
    run = runner(kafka, ledger.handle, topic, batch_size=5)
    try:
        await asyncio.wait_for(run.run(until_idle=True), 60)
    finally:
        await ledger.close()
    assert ledger.applied() == ids  # the old pipeline committed r-2 last
    assert run.outcomes[Outcome.PROCESSED] == 5 and run.outcomes[Outcome.RETRY] == 0


async def _true(value: bool) -> bool:
    return value


async def test_a_dead_letter_the_broker_refuses_for_good_does_not_hold_the_partition(
    ledger: Ledger, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker itself refuses every record on the dead-letter topic (a broker of the
    test's own, whose schema registry no record passes; aiokafka's error is not retriable):
    sending it again can never succeed, so the copy without the value is tried, refused too,
    the loss is logged at ERROR, and the partition goes on; the FAILED record is kept, so
    the failure stays listed. (It used to be read again forever: issue 17, item 8.)"""
    topic = f"cdd-dlqdown-{uuid.uuid4().hex[:10]}"
    async with refusing_broker(tmp_path, [topic + ".dlq"]) as broker:
        await broker.create(name=topic)
        await broker.produce(topic, body(1), event_id="m-1")
        await broker.produce(topic, body(2, fail="poison"), event_id="m-2")
        await broker.produce(topic, body(3), event_id="m-3")
        group = "group-" + topic
        refused = runner(broker.service, ledger.handle, topic)
        await asyncio.wait_for(refused.run(until_idle=True), 60)
        assert ledger.applied() == ["m-1", "m-3"]
        assert await broker.committed(group, topic) == {0: 3}
        assert await broker.records(topic + ".dlq") == []
        assert refused.outcomes[Outcome.FAILED] == 1  # not read again
        assert "m-2" in ledger.recorded()
        [lost] = [r for r in caplog.records if "not even without its value" in r.getMessage()]
        assert lost.levelname == "ERROR" and "FAILED record is kept" in lost.getMessage()


async def test_the_default_dead_letter_producer_is_idempotent_and_a_refusal_stops_run(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """KafkaConfig() as shipped: the dead-letter producer asks for idempotence. A broker that
    grants it takes the dead letter. Tansu 0.6 refuses InitProducerId (no idempotent
    producer): a setup fault, so run() raises at once a ConfigurationError naming
    idempotent_producer=False, before any record is handled (it used to start, then hold
    the partition at the first dead letter); a runner with idempotent_producer=False then
    handles and dead-letters everything. (The idempotent producer on a broker that grants
    it, and its errors: the next test.)"""
    assert KafkaConfig().idempotent_producer is True
    topic = await topics.create("idem")
    await topics.produce(topic, body(1), event_id="m-1")
    await topics.produce(topic, body(2, fail="poison"), event_id="m-2")
    await topics.produce(topic, body(3), event_id="m-3")
    group = "group-" + topic
    options = {**FAST, "consumer_options": kafka.group_options}
    shipped = KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=KafkaConfig(**options),
    )
    if kafka.idempotence:
        await shipped.run(until_idle=True)
        [dead] = await topics.records(topic + ".dlq")
        assert headers_of(dead)[REASON_HEADER] == b"PermanentError: poison"
        assert await topics.committed(group, topic) == {0: 3}
        return
    with pytest.raises(ConfigurationError, match=r"idempotent_producer=False"):
        await asyncio.wait_for(shipped.run(), 60)
    assert ledger.applied() == [] and ledger.recorded() == set()
    assert await topics.committed(group, topic) == {0: 0}

    await runner(kafka, ledger.handle, topic, idempotent_producer=False).run(until_idle=True)
    [dead] = await topics.records(topic + ".dlq")
    assert headers_of(dead)[REASON_HEADER] == b"PermanentError: poison"
    assert sorted(ledger.applied()) == ["m-1", "m-3"]
    assert await topics.committed(group, topic) == {0: 3}


@pytest.mark.parametrize(
    "script",
    [
        # What a broker that grants idempotence can answer: the sequence broken (the
        # producer's session, not the record: a new producer sends it), too few in-sync
        # replicas (retriable). IdempotentWrite not allowed at InitProducerId stops run():
        # tests/kafka/test_round3.py.
        [("send", OutOfOrderSequenceNumber()), ("send", UnknownProducerId())],
        [("send", NotEnoughReplicasError())],
    ],
    ids=["sequence-errors", "not-enough-replicas"],
)
async def test_the_idempotent_dead_letter_producer_on_a_broker_that_grants_it(
    kafka: KafkaService,
    topics: Topics,
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    script: list[tuple[str, Exception]],
) -> None:
    """Tansu 0.6 has no idempotent producer, so the dead-letter producer of KafkaConfig() is
    a double here (tests/kafka_doubles.py) that grants idempotence and first raises
    aiokafka's own errors: each failed dead letter holds the offset and the record is read
    again, until one is accepted; then, and only then, the offset moves past it."""
    double = grants_idempotence(monkeypatch, list(script))
    topic = await topics.create("granted")
    await topics.produce(topic, body(1), event_id="m-1")
    await topics.produce(topic, body(2, fail="poison"), event_id="m-2")
    await topics.produce(topic, body(3), event_id="m-3")
    group = "group-" + topic
    options = {**FAST, "consumer_options": kafka.group_options}
    shipped = KafkaConsumerRunner(
        ledger.handle,
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=group,
        config=KafkaConfig(**options),
    )
    await shipped.run(until_idle=True)

    assert double.script == []  # every scripted error was raised
    assert {(b["enable_idempotence"], b["acks"]) for b in double.built} == {(True, "all")}
    [dead] = double.sent
    assert (dead.topic, dead.value) == (topic + ".dlq", body(2, fail="poison"))
    assert dict(dead.headers)[REASON_HEADER] == b"RecordedFailure: PermanentError: poison"
    assert shipped.outcomes[Outcome.FAILED] == len(script) + 1  # read again after each error
    assert sorted(ledger.applied()) == ["m-1", "m-3"]
    assert await topics.committed(group, topic) == {0: 3}


async def test_a_blocking_deduplicator_handler_runs_in_a_thread(
    kafka: KafkaService, topics: Topics, pg: Any
) -> None:
    table = pg.create_ledger()
    dedup = Deduplicator(pg.engine, consumer="ledger", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Any) -> None:
        session.execute(
            text(f"INSERT INTO {table} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    topic = await topics.create("sync")
    for i in [1, 2, 1, 3]:
        await topics.produce(topic, body(i), event_id=f"m-{i}")
    run = runner(kafka, handle, topic)
    await run.run(until_idle=True)
    assert pg.scalar(f"SELECT count(*) FROM {table}") == 3
    assert run.outcomes[Outcome.DUPLICATE] == 1


async def test_a_record_to_a_partition_is_handled_in_order_across_partitions(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    topic = await topics.create("order", partitions=3)
    seen: list[Message] = []

    async def before(message: Message) -> None:
        seen.append(message)

    ledger.before = before
    await topics.produce_many(topic, [(f"m-{i:03d}", body(i)) for i in range(90)], partitions=3)
    await runner(kafka, ledger.handle, topic, batch_size=7).run(until_idle=True)
    for partition in range(3):
        offsets = [m.offset for m in seen if m.partition == partition]
        assert offsets == list(range(30)), partition
    assert len(set(ledger.applied())) == 90
    assert await topics.committed("group-" + topic, topic) == {0: 30, 1: 30, 2: 30}


async def test_an_idle_runner_notices_stop_within_its_poll_timeout(
    kafka: KafkaService, topics: Topics, ledger: Ledger
) -> None:
    """KafkaConfig.poll_timeout bounds how late an idle stop() is noticed (the README); then
    the consumer leaves its group and closes, and run() returns."""
    topic = await topics.create("idle")
    await topics.produce(topic, body(1), event_id="m-1")
    idle = runner(kafka, ledger.handle, topic)  # poll_timeout 100 ms
    task = asyncio.create_task(idle.run())
    await wait_for(lambda: _true(ledger.applied() == ["m-1"]), "m-1 to be applied")
    await asyncio.sleep(0.3)  # idle: waiting in getmany
    started = time.monotonic()
    idle.stop()
    await asyncio.wait_for(task, 30)
    took = time.monotonic() - started
    poll = FAST["poll_timeout"].total_seconds()
    assert took < poll + CLOSE + MARGIN, f"run() returned {took:.2f} s after stop()"


def test_config_is_validated_at_construction() -> None:
    for bad in [
        {"batch_size": 0},
        {"poll_timeout": timedelta(0)},
        {"retry_delay": timedelta(seconds=-1)},
        {"retry_delay": timedelta(seconds=2), "max_retry_delay": timedelta(seconds=1)},
        {"id_header": ""},
        {"key": "not callable"},
        {"dead_letter_topic": "{topic}"},
        {"dead_letter_topic": "{queue}.dlq"},
        {"consumer_options": {"enable_auto_commit": True}},
        {"consumer_options": {"group_id": "g"}},
        {"producer_options": {"acks": 1}},
    ]:
        with pytest.raises(ConfigurationError):
            KafkaConfig(**bad)
    assert KafkaConfig().dead_letters_of("orders") == "orders.dlq"
    assert KafkaConfig(dead_letter_topic="dlq.{topic}").dead_letters_of("x") == "dlq.x"


def test_runner_arguments_are_validated(sqlite_db: Any) -> None:
    dedup = Deduplicator(sqlite_db.engine, consumer="ledger", tables=sqlite_db.tables)
    handle = dedup.handler(lambda message, session: None)
    with pytest.raises(ConfigurationError):
        KafkaConsumerRunner(lambda m: None, "orders")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        KafkaConsumerRunner(handle, [])
    with pytest.raises(ConfigurationError):
        KafkaConsumerRunner(handle, ["orders", "orders.dlq"])
    assert KafkaConsumerRunner(handle, "orders").group_id == "ledger"


def test_a_missing_processed_events_stops_the_runner_before_it_joins_the_group(
    db: Any,
) -> None:
    """Doctor's start check (issue 23) runs before the consumer is built: the missing table
    and the fix, not BrokerUnavailable (nothing listens at this address), and no offset
    of any group is committed because none was joined."""
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)
    handler = dedup.handler(lambda message, session: None)
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {db.name('processed_events')}")
    runner = KafkaConsumerRunner(handler, "t", bootstrap_servers="127.0.0.1:1", group_id="g")
    with pytest.raises(ConfigurationError) as refused:
        asyncio.run(runner.run())
    said = str(refused.value)
    assert db.tables.processed_events.fullname in said and "consumerdedup init-db" in said
