"""The shop of tests/failed (and tests/attacks): a consumer whose handler reads ``field``
of each order. The bad deploy reads a field the orders lack (KeyError: every order FAILED
and dead-lettered); the fix reads the right one. ``RabbitShop`` and ``KafkaShop`` consume
from their broker; the ledger, the records and ``consumerdedup failed`` run for real in a
subprocess are the same for both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from consumerdedup import DedupHandler, Deduplicator, Message, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.cli.failed import PAUSE_AFTER
from tests.conftest import Database
from tests.support.kafka_service import KafkaService, Topics
from tests.support.rabbitmq_service import Broker

ROOT = Path(__file__).resolve().parents[2]
ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
IDS = [f"order-{n}" for n in range(1, 6)]


def order(amount: int) -> bytes:
    """An order as the producer sends it: it has an ``item``, not the ``sku`` of the bad
    deploy."""
    return json.dumps({"item": "book", "amount": amount}).encode()


class Shop:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.ledger = db.create_ledger()
        self.field = "sku"  # the bad deploy
        self.dedup = Deduplicator(db.engine, consumer="shop", tables=db.tables, retry=ONCE)

    def handler(self) -> DedupHandler:
        """The handler as deployed now: it reads the order's ``field``."""

        @self.dedup.handler
        def handle(message: Message, session: Any) -> None:
            found = message.json()
            session.execute(
                text(f"INSERT INTO {self.ledger} VALUES (:a, :n, :m)"),
                {"a": found[self.field], "n": found["amount"], "m": message.id},
            )

        return handle

    def outcomes(self) -> dict[str, str]:
        pe = self.db.tables.processed_events.fullname
        with self.db.engine.connect() as conn:
            return dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {self.ledger}")))

    def replay_args(self) -> list[str]:
        """``replay`` with this shop's broker and dead-letter source."""
        raise NotImplementedError

    def cli(self, *args: str) -> list[str]:
        """The command line of ``consumerdedup failed ARGS`` on this shop's database."""
        database = ["--db", self.db.url]
        database += ["--processed-events-table", self.db.tables.processed_events.fullname]
        return [sys.executable, "-m", "consumerdedup", "failed", *args, *database]

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.cli(*args), input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        print(f"$ consumerdedup failed {' '.join(args)}\n{done.stdout}{done.stderr}")
        return done

    def replay_killed_after(self, copies: int) -> list[str]:
        """``failed replay --yes`` told to pause once ``copies`` copies are acknowledged,
        killed with SIGKILL there: the lines it printed up to the pause."""
        process = subprocess.Popen(
            self.cli(*self.replay_args(), "--yes"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, PAUSE_AFTER: str(copies)},
        )
        try:
            assert process.stdout is not None
            lines = [process.stdout.readline() for _ in range(copies + 1)]
            assert lines[-1].startswith("paused"), lines
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        return lines


class RabbitShop(Shop):
    """The shop on a RabbitMQ queue (with its ``.dlq``), the orders published at start."""

    def __init__(self, db: Database, rabbit: Broker) -> None:
        super().__init__(db)
        self.rabbit = rabbit
        self.queue = rabbit.queue("shop")
        for n, message_id in enumerate(IDS, 1):
            rabbit.publish(self.queue, order(n), message_id, headers={"trace": message_id})

    def consume(self) -> None:
        config = RabbitConfig(idle_timeout=timedelta(milliseconds=300), retry_delay=timedelta(0))
        handle, url = self.handler(), self.rabbit.url
        runner = RabbitConsumerRunner(handle, self.queue, url=url, config=config)
        runner.run(until_idle=True)

    def replay_args(self) -> list[str]:
        return ["replay", "--rabbitmq", self.rabbit.url, "--queue", self.queue]


class KafkaShop(Shop):
    """The shop on a Kafka topic (with its ``.dlq`` topic); ``kafka_shop`` makes one."""

    def __init__(
        self, db: Database, kafka: KafkaService, topic: str, offsets: str = "broker"
    ) -> None:
        super().__init__(db)
        self.kafka, self.topic, self.offsets = kafka, topic, offsets

    async def consume(self) -> None:
        config = self.kafka.config(poll_timeout=timedelta(milliseconds=100), offsets=self.offsets)
        runner = KafkaConsumerRunner(
            self.handler(),
            self.topic,
            bootstrap_servers=self.kafka.bootstrap,
            group_id="shop-" + self.topic,
            config=config,
        )
        await runner.run(until_idle=True)

    def replay_args(self) -> list[str]:
        return ["replay", "--kafka", self.kafka.bootstrap, "--topic", self.topic]


async def kafka_shop(
    db: Database, kafka: KafkaService, topics: Topics, offsets: str = "broker"
) -> KafkaShop:
    """A new topic holding the five orders (each with a ``trace`` header), and its shop;
    ``offsets``: its runners' ``KafkaConfig.offsets``."""
    topic = await topics.create("shop")
    for n, message_id in enumerate(IDS, 1):
        await topics.produce(topic, order(n), event_id=message_id, headers=[("trace", b"t")])
    return KafkaShop(db, kafka, topic, offsets)
