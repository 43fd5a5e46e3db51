"""A bad deploy on Kafka (Tansu), recovered with ``failed replay --kafka``: the dead-letter
topic's records re-produced to their source topic, the replay group's offsets on the DLQ
committed after; a replay killed between a copy's ack and the commit doubles nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, RetryPolicy
from consumerdedup.adapters.kafka import KafkaConsumerRunner
from consumerdedup.cli.failed import PAUSE_AFTER
from tests.conftest import Database
from tests.support.kafka_service import (  # noqa: F401
    KafkaService,
    Topics,
    kafka_fixture,
    topics_fixture,
)

ROOT = Path(__file__).resolve().parents[2]
ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
IDS = [f"order-{n}" for n in range(1, 6)]


class Shop:
    def __init__(self, db: Database, kafka: KafkaService, topic: str) -> None:
        self.db, self.kafka, self.topic = db, kafka, topic
        self.ledger = db.create_ledger()
        self.field = "sku"  # the bad deploy
        self.dedup = Deduplicator(db.engine, consumer="shop", tables=db.tables, retry=ONCE)

    async def consume(self) -> None:
        @self.dedup.handler
        def handle(message: Message, session: Any) -> None:
            order = message.json()
            session.execute(
                text(f"INSERT INTO {self.ledger} VALUES (:a, :n, :m)"),
                {"a": order[self.field], "n": order["amount"], "m": message.id},
            )

        config = self.kafka.config(poll_timeout=timedelta(milliseconds=100))
        runner = KafkaConsumerRunner(
            handle,
            self.topic,
            bootstrap_servers=self.kafka.bootstrap,
            group_id="shop-" + self.topic,
            config=config,
        )
        await runner.run(until_idle=True)

    def outcomes(self) -> dict[str, str]:
        pe = self.db.tables.processed_events.fullname
        with self.db.engine.connect() as conn:
            return dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {self.ledger}")))

    def command(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "consumerdedup",
            "failed",
            "replay",
            "--kafka",
            self.kafka.bootstrap,
            "--topic",
            self.topic,
            *args,
            "--db",
            self.db.url,
            "--processed-events-table",
            self.db.tables.processed_events.fullname,
        ]

    def replay_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.command(*args), capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        print(
            f"$ consumerdedup failed replay --kafka ... {' '.join(args)}\n{done.stdout}"
            f"{done.stderr}"
        )
        return done


@pytest.fixture
async def shop(pg: Database, kafka: KafkaService, topics: Topics) -> Shop:
    topic = await topics.create("shop")
    for n, message_id in enumerate(IDS, 1):
        value = json.dumps({"item": "book", "amount": n}).encode()
        await topics.produce(topic, value, event_id=message_id, headers=[("trace", b"t")])
    shop = Shop(pg, kafka, topic)
    await shop.consume()
    assert shop.outcomes() == dict.fromkeys(IDS, "failed") and shop.applied() == []
    assert len(await topics.records(topic + ".dlq")) == 5
    return shop


async def test_a_bad_deploy_recovered_with_failed_replay_kafka(shop: Shop, topics: Topics) -> None:
    shop.field = "item"  # the fix
    done = shop.replay_cli("--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 5 FAILED" in done.stdout
    copies = (await topics.records(shop.topic))[5:]
    assert [dict(r.headers)["event_id"].decode() for r in copies] == IDS
    assert all(not k.startswith("x-dead-letter-") for r in copies for k, _ in r.headers)
    await shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert len(await topics.records(shop.topic + ".dlq")) == 5  # a topic keeps its records
    again = shop.replay_cli("--yes")  # the group's committed offsets: nothing left
    assert "replayed 0 dead letter(s)" in again.stdout, again.stdout


async def test_a_replay_killed_before_its_commit_doubles_nothing(shop: Shop) -> None:
    """SIGKILL after the third copy was acknowledged: no offset was committed yet."""
    shop.field = "item"
    process = subprocess.Popen(
        shop.command("--yes"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, PAUSE_AFTER: "3"},
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(4)]
        assert lines[-1].startswith("paused"), lines
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    await shop.consume()  # the three copies apply
    assert shop.applied() == IDS[:3]
    done = shop.replay_cli("--yes")
    # Nothing was committed: all five go again; the three completed records are kept
    # (the killed run had forgotten its whole batch first).
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 0 FAILED" in done.stdout
    await shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
