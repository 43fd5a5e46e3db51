"""The roles of the end-to-end chaos test (tests/project/test_chaos.py), one process each.

    producers -> outbox -> 2 relays -> RabbitMQ -> 2 consumers (a write + an outbox event each)
              -> outbox_kafka -> 1 relay -> Kafka -> 2 consumers

Each role uses the public API only and runs until it is killed (SIGKILL at a random
moment, then started again) or stopped (SIGTERM, after on_signals()); a producer also
returns once its events are all committed. Run as
``python -m tests.support.chaos_roles ROLE INDEX CONFIG_JSON`` with the repository as working
directory. Kept free of pytest so that it imports fast in every restarted process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import json
import logging
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDedupHandler,
    AsyncDeduplicator,
    DedupHandler,
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    RelayConfig,
    Tables,
)

MID_CONSUMER = "chaos-mid"
"""The dedup consumer name of the RabbitMQ consumers."""
FINAL_CONSUMER = "chaos-final"
"""The dedup consumer name of the Kafka consumers."""
RELAY = RelayConfig(
    batch_size=10,
    poll_interval=timedelta(milliseconds=200),
    initial_backoff=timedelta(milliseconds=100),
    max_backoff=timedelta(seconds=1),
)


@dataclass(frozen=True)
class Chaos:
    """Everything a role needs, passed as JSON on its command line."""

    tag: str
    """Unique per run: broker connection names and the producers' lock start with it."""
    seed: int
    db_url: str
    """PostgreSQL (psycopg) or MySQL/MariaDB (PyMySQL; async_url: aiomysql)."""
    async_url: str
    schema: str
    amqp_url: str
    exchange: str
    """A fanout exchange: the work queue and the test's tap queue are bound to it."""
    work_queue: str
    bootstrap: str
    topic: str
    group: str
    idempotence: bool
    group_options: dict[str, Any] = field(default_factory=dict)
    producers: int = 3
    events: int = 200
    keys: int = 20
    pause: float = 0.4
    """Mean pause (seconds) between two bursts of one producer's events..."""
    burst: int = 8
    """... which are about this long: relay rounds of several rows, so that a relay killed
    in its transaction has often published some of them already (and publishes them again)."""
    offsets: str = "broker"
    """The Kafka consumers' ``KafkaConfig.offsets``: "database" keeps them in
    consumer_offsets, in each chunk's transaction (issue 36)."""
    producer_holds: list[list[tuple[int, bool]]] = field(default_factory=list)
    """Per producer, the test's kill thresholds (its count of committed events) and whether
    that kill is to come inside a transaction: the producer holds there until it is killed
    (at most HOLD_LIMIT seconds), so a producer never finishes with kills owed to it. Its
    200 events otherwise take about as long as the waits the test keeps after each restart
    and for a transaction, and a fast producer outran them (chaos incomplete)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> Chaos:
        return cls(**json.loads(raw))

    def tables(self) -> tuple[Tables, Tables]:
        """The producers' outbox (relayed to RabbitMQ) and the RabbitMQ consumers' outbox
        (relayed to Kafka): one table per relay kind, since a relay publishes every row of its
        table to its own broker. processed_events is shared (consumer names differ)."""
        events = f"{self.schema}.processed_events"
        return (
            Tables.define(events, f"{self.schema}.outbox"),
            Tables.define(events, f"{self.schema}.outbox_kafka"),
        )

    @property
    def mysql(self) -> bool:
        return self.db_url.startswith(("mysql", "mariadb"))

    def connect_args(self, role: str, index: int) -> dict[str, str]:
        """PostgreSQL: connections named ``{tag}:{role}-{index}`` in pg_stat_activity (the
        test kills some roles while they are inside a transaction). MySQL has no such
        name: the test finds a role's sessions by their client ports (test_chaos)."""
        if self.mysql:
            return {}
        return {"application_name": application_name(self.tag, role, index)}

    def engine(self, role: str, index: int, pool_size: int = 2) -> Engine:
        return create_engine(
            self.db_url,
            pool_size=pool_size,
            max_overflow=2,
            connect_args=self.connect_args(role, index),
        )

    def table(self, name: str) -> str:
        return f"{self.schema}.{name}"

    def expected(self) -> dict[str, str]:
        """Every business id the producers make, with its key."""
        return {
            event_name(p, n): event_key(self.seed, p, n, self.keys)
            for p in range(self.producers)
            for n in range(self.events)
        }


def application_name(tag: str, role: str, index: int) -> str:
    return f"{tag}:{role}-{index}"


def event_name(producer: int, n: int) -> str:
    return f"p{producer}-{n:03d}"


def event_key(seed: int, producer: int, n: int, keys: int) -> str:
    """The same key for the same event in every incarnation of its producer."""
    return f"k{random.Random(f'{seed}:{producer}:{n}').randrange(keys):02d}"


def create_business_tables(engine: Engine, schema: str) -> None:
    """One table per hop, WITHOUT unique keys: a message applied twice is a second row.
    ``seq`` numbers rows in insertion order, to check per-key order (MySQL: an
    AUTO_INCREMENT key, which it must be; the business id stays without one). The event's
    key is ``ekey`` (KEY is a reserved word in MySQL)."""
    mysql = engine.dialect.name in ("mysql", "mariadb")
    seq = "seq BIGINT AUTO_INCREMENT PRIMARY KEY" if mysql else "seq BIGSERIAL"
    with engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE TABLE {schema}.produced "
                f"({seq}, producer INT, n INT, id VARCHAR(64), ekey VARCHAR(64))"
            )
        )
        for hop in ("mid_effects", "final_effects"):
            conn.execute(
                text(
                    f"CREATE TABLE {schema}.{hop} ({seq}, id VARCHAR(64), ekey VARCHAR(64), "
                    "event_id VARCHAR(64), worker VARCHAR(64))"
                )
            )


HOLD_LIMIT = 30.0
"""Seconds a producer holds at a kill threshold (the test kills it well before; past this,
as when the test's chaos time is over, it goes on)."""


def produce(cfg: Chaos, index: int) -> None:
    """Commit events p{index}-000, p{index}-001...: a business row and an outbox event
    in one transaction each, resuming after the last one committed by an earlier incarnation.

    A session-level advisory lock (per run and producer) on the same connection: it is taken
    only once the previous incarnation's backend has ended, so after anything that process
    sent (a COMMIT in flight) has been applied, and the resume point is exact. MySQL:
    GET_LOCK, a session's named lock, released alike when its session ends.
    """
    engine = cfg.engine("producer", index, pool_size=1)
    outbox = Outbox(cfg.tables()[0])
    produced = cfg.table("produced")
    with engine.connect() as conn:
        if cfg.mysql:
            got = conn.execute(text("SELECT GET_LOCK(:name, 120)"), {"name": f"{cfg.tag}:{index}"})
            assert got.scalar() == 1, "the previous incarnation's session never ended"
        else:
            conn.execute(
                text("SELECT pg_advisory_lock(hashtext(:tag), :p)"), {"tag": cfg.tag, "p": index}
            )
        last = conn.execute(
            text(f"SELECT coalesce(max(n), -1) FROM {produced} WHERE producer = :p"), {"p": index}
        ).scalar_one()
        conn.commit()
        pace = random.Random(f"{cfg.seed}:pace:{index}:{last}")
        # The kills still owed: those past the count of events committed so far.
        holds = dict(cfg.producer_holds[index]) if index < len(cfg.producer_holds) else {}
        holds = {at: inside for at, inside in holds.items() if at > last + 1}
        for n in range(last + 1, cfg.events):
            name, key = event_name(index, n), event_key(cfg.seed, index, n, cfg.keys)
            body = json.dumps({"id": name, "key": key}).encode()
            with Session(bind=conn) as session, session.begin():
                session.execute(
                    text(f"INSERT INTO {produced} (producer, n, id, ekey) VALUES (:p, :n, :i, :k)"),
                    {"p": index, "n": n, "i": name, "k": key},
                )
                outbox.add(session, f"{cfg.exchange}/", body, key=key)
                if holds.get(n) is True:  # n events committed: killed in this transaction
                    time.sleep(HOLD_LIMIT)
            if holds.get(n + 1) is False:  # n + 1 committed: killed between transactions
                time.sleep(HOLD_LIMIT)
            if pace.random() < 1 / cfg.burst:
                time.sleep(pace.expovariate(1 / cfg.pause))
    engine.dispose()


def rabbit_relay(cfg: Chaos, index: int) -> None:
    from consumerdedup.adapters.rabbitmq import RabbitPublisher

    engine = cfg.engine("rabbit-relay", index)
    publisher = RabbitPublisher(cfg.amqp_url, connection_name=f"{cfg.tag}:relay-{index}")
    relay = OutboxRelay(engine, publisher, tables=cfg.tables()[0], config=RELAY)
    relay.on_signals()
    relay.run()
    publisher.close()


def kafka_relay(cfg: Chaos, index: int) -> None:
    from consumerdedup.adapters.kafka import KafkaPublisher

    engine = cfg.engine("kafka-relay", index)
    publisher = KafkaPublisher(cfg.bootstrap, enable_idempotence=cfg.idempotence)
    relay = OutboxRelay(engine, publisher, tables=cfg.tables()[1], config=RELAY)
    relay.on_signals()
    relay.run()


def mid_consumer(cfg: Chaos, index: int) -> None:
    """RabbitMQ -> a business row and an outbox event for Kafka, in one transaction."""
    from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner

    engine = cfg.engine("mid", index)
    tables, kafka_tables = cfg.tables()
    outbox = Outbox(kafka_tables)
    effects = cfg.table("mid_effects")
    dedup = Deduplicator(engine, consumer=MID_CONSUMER, tables=tables)

    @dedup.handler
    def forward(message: Message, session: Session) -> None:
        data = message.json()
        session.execute(
            text(f"INSERT INTO {effects} (id, ekey, event_id, worker) VALUES (:i, :k, :e, :w)"),
            {"i": data["id"], "k": data["key"], "e": message.id, "w": f"mid-{index}"},
        )
        outbox.add(session, cfg.topic, message.body, key=data["key"])

    config = RabbitConfig(
        prefetch=10,
        batch_size=5,
        declare=True,
        retry_delay=timedelta(milliseconds=100),
        max_retry_delay=timedelta(seconds=1),
        reconnect_delay=timedelta(milliseconds=100),
        max_reconnect_delay=timedelta(seconds=1),
        connection_name=f"{cfg.tag}:mid-{index}",
    )
    runner = RabbitConsumerRunner(forward, cfg.work_queue, url=cfg.amqp_url, config=config)
    runner.on_signals()
    runner.run()


def final_consumer(cfg: Chaos, index: int) -> None:
    """Kafka -> a business row. Consumer 0 is an AsyncDeduplicator, 1 a blocking one."""
    from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner

    tables = cfg.tables()[1]
    effects = cfg.table("final_effects")
    insert = text(f"INSERT INTO {effects} (id, ekey, event_id, worker) VALUES (:i, :k, :e, :w)")

    def row(message: Message) -> dict[str, str]:
        data = message.json()
        return {"i": data["id"], "k": data["key"], "e": str(message.id), "w": f"final-{index}"}

    handler: AsyncDedupHandler | DedupHandler
    if index % 2 == 0:
        name = cfg.connect_args("final", index)
        engine = create_async_engine(cfg.async_url, pool_size=2, connect_args=name)
        async_dedup = AsyncDeduplicator(engine, consumer=FINAL_CONSUMER, tables=tables)

        @async_dedup.handler
        async def apply_async(message: Message, session: AsyncSession) -> None:
            await session.execute(insert, row(message))

        handler = apply_async
    else:
        dedup = Deduplicator(cfg.engine("final", index), consumer=FINAL_CONSUMER, tables=tables)

        @dedup.handler
        def apply(message: Message, session: Session) -> None:
            session.execute(insert, row(message))

        handler = apply

    config = KafkaConfig(
        batch_size=20,
        poll_timeout=timedelta(milliseconds=100),
        retry_delay=timedelta(milliseconds=200),
        max_retry_delay=timedelta(milliseconds=200),
        idempotent_producer=cfg.idempotence,
        consumer_options=cfg.group_options,
        offsets=cfg.offsets,
    )
    runner = KafkaConsumerRunner(
        handler, cfg.topic, bootstrap_servers=cfg.bootstrap, group_id=cfg.group, config=config
    )
    runner.on_signals()
    asyncio.run(runner.run())


ROLES: dict[str, Callable[[Chaos, int], None]] = {
    "producer": produce,
    "rabbit-relay": rabbit_relay,
    "mid": mid_consumer,
    "kafka-relay": kafka_relay,
    "final": final_consumer,
}


def _dump_stacks(signum: int, frame: Any) -> None:
    """SIGUSR1: every thread's stack and every asyncio task's, into the role's log; the test
    asks for it when a role outlives its stop timeout, before it kills the role."""
    faulthandler.dump_traceback(all_threads=True)
    loop = asyncio.events._get_running_loop()
    if loop is not None:
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
    sys.stderr.flush()


def main(argv: list[str]) -> None:
    role, index, raw = argv
    signal.signal(signal.SIGUSR1, _dump_stacks)
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {role}-{index} pid=%(process)d %(name)s %(levelname)s %(message)s",
    )
    ROLES[role](Chaos.from_json(raw), int(index))


if __name__ == "__main__":
    main(sys.argv[1:])
