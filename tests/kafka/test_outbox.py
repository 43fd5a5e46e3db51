"""The outbox relay publishing to a Kafka-protocol broker, and a deduplicating consumer after.

The scenarios every broker shares are in tests/contracts/outbox.py; here are Kafka's own:
a broker restarted mid-stream, and a topic the cluster does not create."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Coroutine, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import select, text
from sqlalchemy.orm import Session

from consumerdedup import (
    Message,
    Outbox,
    OutboxRelay,
    Outcome,
    RelayConfig,
)
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.headers import ID_HEADER
from tests.conftest import database
from tests.contracts.outbox import RelayToBrokerContract
from tests.support.kafka_doubles import no_auto_create
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    free_port,
    kafka_fixture,
    own_service,
    start_tansu,
    topics_fixture,
)
from tests.support.outbox_events import Downstream, add_events, assert_drained

T = TypeVar("T")


def publisher(kafka: KafkaService) -> KafkaPublisher:
    return KafkaPublisher(kafka.bootstrap, enable_idempotence=kafka.idempotence)


class KafkaSide:
    """Destinations are topics of four partitions; downstream takes the records in (partition,
    offset) order through the deduplicating handler. The broker clients run on the side's
    own event loop, in a thread: the scenarios are blocking, as the relay is."""

    def __init__(self, db: Any, kafka: KafkaService) -> None:
        self.db = db
        self.kafka = kafka
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.topics = Topics(kafka)

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def publisher(self) -> KafkaPublisher:
        return publisher(self.kafka)

    def destination(self) -> str:
        return self._call(self.topics.create("outbox", partitions=4))

    def held(self, destination: str) -> list[tuple[str, int, str]]:
        found = []
        for record in self._call(self.topics.records(destination)):
            key, seq = record.value.decode().split(":")
            assert record.key == key.encode()  # the event's key is the record's key
            found.append((key, int(seq), dict(record.headers)[ID_HEADER].decode()))
        return found

    def consume(self, destination: str, downstream: Downstream) -> Counter[Outcome]:
        outcomes: Counter[Outcome] = Counter()
        for record in self._call(self.topics.records(destination)):
            event_id = dict(record.headers)[ID_HEADER].decode()
            message = Message(id=event_id, body=record.value, source=record.topic)
            outcomes[downstream.handler(message)] += 1
        return outcomes

    def close(self) -> None:
        try:
            self._call(self.topics.close())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(params=["postgresql", "mariadb"])
def outbox_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """The shared scenarios' database: PostgreSQL and MariaDB (row locks, no NOTIFY)."""
    yield from database(request, request.param, tmp_path)


class TestRelayToKafka(RelayToBrokerContract):
    @pytest.fixture
    def broker_side(self, outbox_db: Any, kafka: KafkaService) -> Iterator[KafkaSide]:
        side = KafkaSide(outbox_db, kafka)
        yield side
        side.close()


class Gate:
    """A publisher the test can hold at its door: while ``opened`` is clear, the relay's next
    publish waits at it; counts the publishes in flight and those that failed."""

    def __init__(self, real: KafkaPublisher) -> None:
        self.real = real
        self.opened = threading.Event()
        self.opened.set()
        self.in_flight = 0
        self.refused = 0

    async def __aenter__(self) -> Gate:
        await self.real.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.real.stop()

    async def publish(
        self, destination: str, body: bytes, key: Any = None, headers: Any = None
    ) -> None:
        import asyncio

        while not self.opened.is_set():
            await asyncio.sleep(0.01)
        self.in_flight += 1
        try:
            await self.real.publish(destination, body, key, headers)
        except Exception:
            self.refused += 1
            raise
        finally:
            self.in_flight -= 1


async def read_back(port: int, topic: str) -> list[Any]:
    topics = Topics(own_service(port))
    try:
        return await topics.records(topic)
    finally:
        await topics.close()


async def create_topic(port: int, topic: str, partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, partitions, 1)])
    finally:
        await admin.close()


def each_once_in_key_order(records: list[Any], ids: list[str]) -> None:
    """Every event of ``ids`` is on the topic exactly once, nothing else, each key in order."""
    found = Counter(dict(record.headers)["event_id"].decode() for record in records)
    assert found == Counter(ids), f"lost {set(ids) - set(found)}, doubled {found - Counter(ids)}"
    per_key: dict[bytes, list[int]] = defaultdict(list)
    for record in records:  # (partition, offset) order: a key lives in one partition
        per_key[record.key].append(int(record.value.decode().split(":")[1]))
    assert all(seqs == sorted(seqs) for seqs in per_key.values()), per_key


async def test_broker_away_for_seconds_the_relay_backs_off_then_publishes_everything(
    pg: Any,
) -> None:
    """A broker of our own, killed and started again on the same port mid-stream; every
    event is read back from the broker: each exactly once, each key in order.

    Tansu 0.6 keeps its topics in memory: the broker that comes back has none, and
    acknowledges produce requests for a topic it does not have without storing them
    (aiokafka still holds the old metadata). So the test holds the relay at the door
    (``Gate``) while it creates the topic again, as an operator restoring a broker would;
    a lost event then shows as missing from the topic, not only as a published_at stamp.
    """
    import asyncio

    port = free_port()
    topic = f"cdd-outage-{uuid.uuid4().hex[:10]}"
    broker = start_tansu(port)
    await create_topic(port, topic, partitions=2)
    config = RelayConfig(
        batch_size=20,
        poll_interval=timedelta(seconds=0.1),
        initial_backoff=timedelta(milliseconds=100),
        max_backoff=timedelta(milliseconds=500),
    )
    # No idempotent producer on Tansu; a send to a broker away fails after 1 s, not 40.
    options = {"request_timeout_ms": 1000}
    gate = Gate(KafkaPublisher(f"127.0.0.1:{port}", enable_idempotence=False, options=options))
    relay = OutboxRelay(pg.engine, gate, tables=pg.tables, config=config)
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        first = add_events(pg, topic, 50, keys=5)
        await asyncio.to_thread(assert_drained, relay)
        each_once_in_key_order(await read_back(port, topic), first)
        assert gate.refused == 0
        broker.kill()
        broker.wait()
        later = add_events(pg, topic, 50, keys=5)
        deadline = time.monotonic() + 30
        while gate.refused < 3:  # the broker stays away; the relay must keep trying
            assert time.monotonic() < deadline, f"the relay tried {gate.refused} time(s)"
            await asyncio.sleep(0.05)
        assert relay.backlog() == 50
        gate.opened.clear()  # no send may reach the new broker before its topic exists
        deadline = time.monotonic() + 30
        while gate.in_flight:
            assert time.monotonic() < deadline, "a send to the broker away never ended"
            await asyncio.sleep(0.05)
        broker = start_tansu(port)  # memory storage: it comes back empty
        await create_topic(port, topic, partitions=2)
        gate.opened.set()
        await asyncio.to_thread(assert_drained, relay, 90, 30)  # a producer reconnects slowly
        each_once_in_key_order(await read_back(port, topic), later)
    finally:
        relay.stop()
        thread.join(30)
        broker.kill()
        broker.wait()
    assert relay.parked() == []
    with pg.engine.connect() as conn:
        ob = pg.tables.outbox
        unpublished = conn.execute(
            text(f"SELECT count(*) FROM {ob.fullname} WHERE published_at IS NULL")
        ).scalar()
        attempts = conn.execute(text(f"SELECT max(attempts) FROM {ob.fullname}")).scalar()
    assert unpublished == 0
    assert attempts == 0  # the outage charged no event, so none can be parked by it


async def test_an_event_for_a_missing_topic_backs_off_alone_and_the_other_keys_go(
    kafka: KafkaService, topics: Topics, pg: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker refuses to create topics (see tests/support/kafka_doubles.py): the event for the
    missing topic is charged and backs off, holding back only its own key."""
    import asyncio

    no_auto_create(monkeypatch)
    present = await topics.create("present")
    missing = f"cdd-missing-{uuid.uuid4().hex[:10]}"
    outbox = Outbox(pg.tables)
    with Session(pg.engine) as session, session.begin():
        for destination, body, key in [
            (missing, b"a1", "a"),
            (present, b"b1", "b"),
            (present, b"a2", "a"),
            (missing, b"loose", None),
            (present, b"b2", "b"),
        ]:
            outbox.add(session, destination, body, key=key)
    later = RelayConfig(initial_backoff=timedelta(hours=1), max_backoff=timedelta(hours=1))

    def run_twice() -> list[int]:
        with OutboxRelay(pg.engine, publisher(kafka), tables=pg.tables, config=later) as relay:
            return [relay.run_once(), relay.run_once()]

    assert await asyncio.to_thread(run_twice) == [2, 0]  # b1, b2; then nothing is due
    assert [r.value for r in await topics.records(present)] == [b"b1", b"b2"]
    ob = pg.tables.outbox
    with pg.engine.connect() as conn:
        rows = {r.body: r for r in conn.execute(select(ob))}
    now = datetime.now(UTC)
    for body in (b"a1", b"loose"):
        assert rows[body].attempts == 1 and rows[body].available_at > now + timedelta(minutes=50)
        assert "TopicMissing" in rows[body].last_error
    assert rows[b"a2"].attempts == 0 and rows[b"a2"].published_at is None  # behind a1
