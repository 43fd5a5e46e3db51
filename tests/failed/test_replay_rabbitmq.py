"""A bad deploy on RabbitMQ, recovered with ``consumerdedup failed list`` and ``failed replay``
run for real in a subprocess: every message applied once, the DLQ empty, and a replay killed
with SIGKILL between a confirmed copy and its ack loses nothing and doubles nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from consumerdedup import Deduplicator, Message, RetryPolicy
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from consumerdedup.cli.failed import PAUSE_AFTER
from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
IDS = [f"order-{n}" for n in range(1, 6)]


class Shop:
    """A consumer of ``queue`` whose handler reads ``field`` of each order: the bad deploy
    reads a field the orders do not have (KeyError), the fix reads the right one."""

    def __init__(self, db: Database, rabbit: Broker) -> None:
        self.db, self.rabbit = db, rabbit
        self.queue = rabbit.queue("shop")
        self.ledger = db.create_ledger()
        self.field = "sku"  # the bad deploy
        self.dedup = Deduplicator(db.engine, consumer="shop", tables=db.tables, retry=ONCE)
        for n, message_id in enumerate(IDS, 1):
            rabbit.publish(
                self.queue,
                json.dumps({"item": "book", "amount": n}).encode(),
                message_id,
                headers={"trace": message_id},
            )

    def consume(self) -> None:
        @self.dedup.handler
        def handle(message: Message, session: Any) -> None:
            order = message.json()
            session.execute(
                text(f"INSERT INTO {self.ledger} VALUES (:a, :n, :m)"),
                {"a": order[self.field], "n": order["amount"], "m": message.id},
            )

        config = RabbitConfig(idle_timeout=timedelta(milliseconds=300), retry_delay=timedelta(0))
        RabbitConsumerRunner(handle, self.queue, url=self.rabbit.url, config=config).run(
            until_idle=True
        )

    def outcomes(self) -> dict[str, str]:
        pe = self.db.tables.processed_events.fullname
        with self.db.engine.connect() as conn:
            return dict(conn.execute(text(f"SELECT message_id, outcome FROM {pe}")).all())

    def applied(self) -> list[str]:
        with self.db.engine.connect() as conn:
            return sorted(r[0] for r in conn.execute(text(f"SELECT message_id FROM {self.ledger}")))

    def cli(self, *args: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "consumerdedup",
            "failed",
            *args,
            "--db",
            self.db.url,
            "--processed-events-table",
            self.db.tables.processed_events.fullname,
        ]

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.cli(*args), capture_output=True, text=True, cwd=ROOT, timeout=120
        )
        print(f"$ consumerdedup failed {' '.join(args)}\n{done.stdout}{done.stderr}")
        return done

    def replay_args(self) -> list[str]:
        return ["replay", "--rabbitmq", self.rabbit.url, "--queue", self.queue]

    def wait_for(self, queue: str, count: int) -> None:
        """Until the broker holds ``count`` ready in ``queue`` (a killed client's unacked
        messages come back once the broker sees its socket close)."""
        deadline = time.monotonic() + 30
        while self.rabbit.ready(queue) != count:
            assert time.monotonic() < deadline, (queue, self.rabbit.ready(queue), count)
            time.sleep(0.05)


@pytest.fixture
def shop(pg: Database, rabbit: Broker) -> Shop:
    shop = Shop(pg, rabbit)
    shop.consume()  # the bad deploy: every order FAILED, dead-lettered
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5 and shop.applied() == []
    return shop


def test_a_bad_deploy_recovered_with_failed_replay(shop: Shop) -> None:
    listed = shop.run("list", "--consumer", "shop")
    assert listed.returncode == 0, listed.stderr
    assert sum("KeyError" in line for line in listed.stdout.splitlines()) == 5
    as_json = json.loads(shop.run("list", "--json", "--limit", "2").stdout)
    assert [r["message_id"] for r in as_json["records"]] == IDS[:2] and as_json["next_cursor"]
    # Replayed before the fix: they simply fail again and are dead-lettered again.
    again = shop.run(*shop.replay_args(), "--yes")
    assert again.returncode == 0, again.stderr
    shop.consume()
    assert shop.outcomes() == dict.fromkeys(IDS, "failed") and shop.applied() == []
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5
    shop.field = "item"  # the fix
    dry = shop.run(*shop.replay_args(), "--dry-run")
    assert "would replay 5 dead letter(s)" in dry.stdout, dry.stdout
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5 and shop.rabbit.ready(shop.queue) == 0
    refused = subprocess.run(
        shop.cli(*shop.replay_args()),
        input="n\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert refused.returncode == 1 and "not confirmed" in refused.stderr
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    assert "replayed 5 dead letter(s)" in done.stdout and "forgot 5 FAILED" in done.stdout
    assert shop.rabbit.ready(shop.queue + ".dlq") == 0
    copies = shop.rabbit.peek(shop.queue)
    assert [p.message_id for p, _ in copies] == IDS
    assert all(p.headers == {"trace": p.message_id} for p, _ in copies)  # ours stripped
    shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert shop.rabbit.ready(shop.queue + ".dlq") == 0
    assert shop.run("list").stdout == "no FAILED records\n"


def test_a_replay_killed_halfway_loses_nothing_and_doubles_nothing(shop: Shop) -> None:
    shop.field = "item"
    dlq = shop.queue + ".dlq"
    env = {**os.environ, PAUSE_AFTER: "2"}
    process = subprocess.Popen(
        shop.cli(*shop.replay_args(), "--yes"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(3)]
        assert lines[-1].startswith("paused"), lines
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    # The second copy was confirmed and not acked: it is both in the queue and in the DLQ.
    shop.wait_for(dlq, 4)
    assert shop.rabbit.ready(shop.queue) == 2
    shop.consume()  # the two copies apply; their records complete
    assert shop.applied() == IDS[:2]
    done = shop.run(*shop.replay_args(), "--yes")
    assert done.returncode == 0, done.stderr
    # The killed run forgot its whole batch's records first; order-2's dead letter is
    # replayed again, its copy answered from its completed record (never forgotten).
    assert "replayed 4 dead letter(s)" in done.stdout and "forgot 0 FAILED" in done.stdout
    assert shop.rabbit.ready(dlq) == 0
    shop.consume()
    assert shop.applied() == IDS and shop.outcomes() == dict.fromkeys(IDS, "processed")
    assert shop.rabbit.ready(dlq) == 0 and shop.rabbit.ready(shop.queue) == 0
