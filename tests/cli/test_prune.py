"""``consumerdedup prune`` run for real in a subprocess, on SQLite, PostgreSQL and the brokers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pika
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, select, text
from sqlalchemy.engine import make_url

from consumerdedup.prune.statements import PruneStatements
from tests.conftest import Database
from tests.support import services
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import RABBITMQCTL_NEEDED, amqp_url_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
DAY = timedelta(days=1)
PASSWORD = "s3cr3tpw"


@dataclass
class Run:
    code: int
    out: str
    err: str

    def assert_usage_error(self, *fragments: str) -> None:
        assert self.code == 2, (self.code, self.out, self.err)
        self.assert_one_line(*fragments)

    def assert_one_line(self, *fragments: str) -> None:
        assert len(self.err.splitlines()) == 1, self.err
        assert self.err.startswith("consumerdedup: error: ") and "Traceback" not in self.err
        for fragment in fragments:
            assert fragment in self.err, (fragment, self.err)


def command(db: Database, *args: str, url: str | None = None) -> list[str]:
    tables = ["--processed-events-table", db.tables.processed_events.fullname]
    tables += ["--outbox-table", db.tables.outbox.fullname]
    return [sys.executable, "-m", "consumerdedup", "prune", "--db", url or db.url, *tables, *args]


def environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CONSUMERDEDUP_DB_URL"}


def prune(db: Database, *args: str, url: str | None = None) -> Run:
    done = subprocess.run(
        command(db, *args, url=url),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment(),
        timeout=120,
    )
    return Run(done.returncode, done.stdout, done.stderr)


def fill(db: Database) -> None:
    """ledger and mail: one row per day of age, half a day off the boundaries; and the outbox."""
    now = datetime.now(UTC)
    rows = [
        {
            "consumer": consumer,
            "message_id": f"{consumer}-{age}",
            "processed_at": now - age * DAY - DAY / 2,
            "payload_hash": "0" * 64,
            "outcome": "processed",
        }
        for consumer in ("ledger", "mail")
        for age in range(30)
    ]
    outbox: list[dict[str, Any]] = [
        {
            "event_id": f"event-{age}",
            "destination": "out",
            "body": b"{}",
            "headers": {},
            "created_at": now - 40 * DAY,
            "available_at": now - 40 * DAY,
            "published_at": None if age % 2 else now - age * DAY - DAY / 2,
        }
        for age in range(30)
    ]
    with db.engine.begin() as conn:
        conn.execute(insert(db.tables.processed_events), rows)
        conn.execute(insert(db.tables.outbox), outbox)


def ages(db: Database, consumer: str) -> set[int]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        ids = conn.execute(select(pe.c.message_id).where(pe.c.consumer == consumer)).scalars()
        return {int(i.rsplit("-", 1)[1]) for i in ids}


def outbox_left(db: Database) -> tuple[int, int]:
    """(published, unpublished) rows."""
    ob = db.tables.outbox
    with db.engine.connect() as conn:
        stamps = list(conn.execute(select(ob.c.published_at)).scalars())
    return sum(1 for s in stamps if s is not None), sum(1 for s in stamps if s is None)


# --- end to end ---------------------------------------------------------------------------------


def test_dry_run_then_prune_with_a_window_of_its_own(db: Database) -> None:
    fill(db)
    dry = prune(db, "--retention", "7d", "--dry-run")
    assert dry.code == 0, dry.err
    assert "would delete 44 rows" in dry.out and "(ledger 22, mail 22)" in dry.out
    assert "and 11 published rows" in dry.out
    assert ages(db, "ledger") == set(range(30)) and outbox_left(db) == (15, 15)

    run = prune(db, "--retention", "7d", "--window", "mail=20d")
    assert run.code == 0 and run.err == "", run.err
    assert "mail 22d, other consumers 8d; published outbox rows 7d" in run.out
    assert "deleted 30 rows" in run.out and "(ledger 22, mail 8)" in run.out
    assert ages(db, "ledger") == set(range(8))
    assert ages(db, "mail") == set(range(22))
    assert outbox_left(db) == (4, 15)  # published 0, 2, 4, 6 days ago; no unpublished row goes


def test_a_window_of_forever_keeps_that_consumer(sqlite_db: Database) -> None:
    fill(sqlite_db)
    run = prune(sqlite_db, "--retention", "7d", "--window", "mail=forever")
    assert run.code == 0, run.err
    assert "mail forever, other consumers 8d" in run.out
    assert ages(sqlite_db, "mail") == set(range(30)) and ages(sqlite_db, "ledger") == set(range(8))


def test_consumer_and_buffer_choose_what_goes(db: Database) -> None:
    fill(db)
    run = prune(db, "--retention", "2d", "--buffer", "2d", "--consumer", "mail")
    assert run.code == 0, run.err
    assert ages(db, "mail") == set(range(4)) and ages(db, "ledger") == set(range(30))


def test_progress_lines_during_a_long_round(sqlite_db: Database) -> None:
    fill(sqlite_db)
    run = prune(sqlite_db, "--retention", "7d", "--batch-size", "10", "--progress-every", "0")
    assert run.code == 0, run.err
    table = sqlite_db.tables.processed_events.fullname
    progress = [line for line in run.out.splitlines() if line.startswith("...")]
    assert [line.split(" rows")[0] for line in progress][:5] == [
        "... 10",
        "... 20",
        "... 30",
        "... 40",
        "... 44",
    ]
    assert f"rows deleted from {table} so far (" in progress[0]


@pytest.mark.postgres
def test_the_password_is_never_printed(pg: Database) -> None:
    fill(pg)
    url = make_url(pg.url).set(password=PASSWORD).render_as_string(hide_password=False)
    run = prune(pg, "--retention", "7d", url=url)  # the local server trusts: any password works
    assert run.code == 0, run.err
    assert PASSWORD not in run.out + run.err and "***" in run.out


@pytest.mark.postgres
def test_a_round_is_skipped_while_another_pruner_holds_the_lock(pg: Database) -> None:
    fill(pg)
    name = pg.tables.processed_events.fullname
    with pg.engine.connect() as holder:
        assert PruneStatements(pg.tables, "postgresql", [], True).try_lock(holder)
        run = prune(pg, "--retention", "7d")
        holder.execute(text("SELECT pg_advisory_unlock_all()"))
    assert run.code == 0, run.err
    assert f"skipped: another pruner holds the lock on {name}" in run.out
    assert ages(pg, "ledger") == set(range(30))


def test_every_runs_rounds_until_sigterm_then_exits_0(db: Database) -> None:
    fill(db)
    port = free_tcp_port()
    process = subprocess.Popen(
        command(db, "--retention", "7d", "--every", "1h", "--metrics-port", str(port)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=environment(),
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in process.stdout or []:
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        seen = wait_for_line(lines, "deleted 44 rows", timeout=60)
        assert any("running every 1h until SIGTERM" in line for line in seen)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as got:
            scraped = {
                (sample.name, tuple(sorted(sample.labels.items()))): sample.value
                for family in text_string_to_metric_families(got.read().decode())
                for sample in family.samples
            }
        assert scraped[("consumerdedup_prune_rounds_total", ())] == 1
        assert scraped[("consumerdedup_prune_deleted_rows_total", ())] >= 44
        assert scraped[("consumerdedup_database_up", ())] == 1
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    rest = wait_for_line(lines, "pruner stopped", timeout=10)
    assert "pruner stopped after 1 round(s): " in rest[-1], rest
    stamp = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")  # a long run's every line
    assert all(stamp.match(line) for line in [*seen, *rest]), [*seen, *rest]
    assert process.stderr is not None and process.stderr.read() == ""
    assert ages(db, "ledger") == set(range(8))


def free_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_line(lines: queue.Queue[str], wanted: str, timeout: float) -> list[str]:
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while not seen or wanted not in seen[-1]:
        left = deadline - time.monotonic()
        assert left > 0, f"no line with {wanted!r} in {seen}"
        try:
            seen.append(lines.get(timeout=left))
        except queue.Empty:
            continue
    return seen


# --- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--retention", "-1d"], "is negative"),
        (["--retention=-1d"], "is negative"),
        (["--retention", "forever"], "finite window; to keep one consumer's records forever"),
        (["--retention", "7x"], "is not a duration"),
        (["--retention", "7M"], "units are lowercase"),
        (["--retention", "-7M"], "is negative"),
        (["--retention", "0d"], "is zero"),
        (["--retention", "7d", "--buffer", "0s"], "--buffer '0s' is zero"),
        (["--retention", "7d", "--consumer", "ledgr"], "unknown consumer(s) 'ledgr'"),
        (["--retention", "7d", "--window", "audit=30d"], "unknown consumer(s) 'audit'"),
        (["--retention", "7d", "--window", "ledger"], "expected NAME=DURATION"),
        (["--retention", "7d", "--batch-size", "0"], "--batch-size must be >= 1"),
        (["--retention", "7d", "--progress-every", "soon"], "--progress-every 'soon' is not"),
        (["--retention", "7d", "--topics", "a"], "--topics goes with --kafka"),
        (["--kafka", "127.0.0.1:1"], "--kafka needs --topics"),
        (["--kafka", "127.0.0.1:1", "--topics", "a"], "applies only to the consumers of a"),
        (["--rabbitmq", "amqp://127.0.0.1:1", "--queues", "q"], "name them with --consumer"),
        ([], "one of the arguments --retention --kafka --rabbitmq is required"),
        (["--retention", "7d", "--kafka", "x:1"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    sqlite_db: Database, args: list[str], fragment: str
) -> None:
    fill(sqlite_db)
    prune(sqlite_db, *args).assert_usage_error(fragment)
    assert ages(sqlite_db, "ledger") == set(range(30))


def test_missing_tables_is_a_runtime_error(tmp_path: Path, sqlite_db: Database) -> None:
    empty = f"sqlite:///{tmp_path / 'empty.db'}"
    run = prune(sqlite_db, "--retention", "7d", url=empty)
    assert run.code == 1
    run.assert_one_line("table(s) not found", "init-db")


# --- retention from the broker ------------------------------------------------------------------


def make_topic(kafka: KafkaService, **configs: str) -> str:
    name = f"cdd-prune-{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(name, 1, 1, topic_configs=configs)])
        finally:
            await admin.close()

    asyncio.run(create())
    return name


def test_kafka_retention_read_from_the_topics(sqlite_db: Database, kafka: KafkaService) -> None:
    fill(sqlite_db)
    topic = make_topic(kafka, **{"retention.ms": str(5 * 86_400_000), "segment.ms": "86400000"})
    run = prune(sqlite_db, "--kafka", kafka.bootstrap, "--topics", topic, "--consumer", "ledger")
    assert run.code == 0, run.err
    assert f"{topic}: 6d (retention.ms=432000000 + segment.ms=86400000)" in run.out
    assert ages(sqlite_db, "ledger") == set(range(7))  # 6 days + the 1-day buffer
    assert ages(sqlite_db, "mail") == set(range(30))


def test_kafka_infinite_retention_prunes_nothing_and_says_so(
    sqlite_db: Database, kafka: KafkaService
) -> None:
    fill(sqlite_db)
    finite, infinite = (
        make_topic(kafka, **{"retention.ms": "1000"}),
        make_topic(kafka, **{"retention.ms": "-1"}),
    )
    topics = f"{finite},{infinite}"
    run = prune(sqlite_db, "--kafka", kafka.bootstrap, "--topics", topics, "--consumer", "ledger")
    assert run.code == 0, run.err
    assert f"{infinite} keep(s) records forever: the records of ledger are never" in run.out
    assert "deleted 0 rows" in run.out
    assert ages(sqlite_db, "ledger") == set(range(30))


def test_kafka_without_retention_asks_for_it(sqlite_db: Database, kafka: KafkaService) -> None:
    """Tansu reports no retention.ms for a topic without one; a real Kafka its default."""
    topic = make_topic(kafka)
    run = prune(sqlite_db, "--kafka", kafka.bootstrap, "--topics", topic, "--consumer", "ledger")
    if kafka.kind != "tansu":
        assert run.code == 0, run.err
        assert f"{topic}: " in run.out and "retention.ms=" in run.out
        return
    run.assert_usage_error(f"no retention.ms for topic(s) {topic}", "pass --retention DURATION")


def test_rabbitmq_queue_ttl_sets_the_retention(sqlite_db: Database, amqp_url: str) -> None:
    services.tool("rabbitmqctl", RABBITMQCTL_NEEDED)
    fill(sqlite_db)
    with rabbit_queues(amqp_url) as (with_ttl, without):
        run = prune(sqlite_db, "--rabbitmq", amqp_url, "--queues", with_ttl, "--consumer", "ledger")
        assert run.code == 0, run.err
        assert f"{with_ttl}: 2d (x-message-ttl=172800000)" in run.out
        assert ages(sqlite_db, "ledger") == set(range(3))
        assert ages(sqlite_db, "mail") == set(range(30))

        both = f"{with_ttl},{without}"
        asked = prune(sqlite_db, "--rabbitmq", amqp_url, "--queues", both, "--consumer", "ledger")
        asked.assert_usage_error(f"{without} in vhost '/' have no message TTL", "--retention")


@pytest.mark.parametrize("broker", ["kafka", "rabbitmq"])
def test_an_unscoped_broker_window_is_refused(
    sqlite_db: Database, request: pytest.FixtureRequest, broker: str
) -> None:
    fill(sqlite_db)
    with contextlib.ExitStack() as stack:
        if broker == "kafka":
            kafka: KafkaService = request.getfixturevalue("kafka")
            topic = make_topic(kafka, **{"retention.ms": str(86_400_000)})
            source = ["--kafka", kafka.bootstrap, "--topics", topic]
        else:
            url = request.getfixturevalue("amqp_url")
            source = ["--rabbitmq", url, "--queues", stack.enter_context(rabbit_queues(url))[0]]
        for extra in ([], ["--window", "mail=30d"], ["--dry-run"]):
            run = prune(sqlite_db, *source, *extra)
            run.assert_usage_error("applies only to the consumers of", "--consumer NAME")
    assert ages(sqlite_db, "ledger") == set(range(30))
    assert ages(sqlite_db, "mail") == set(range(30))


@contextlib.contextmanager
def rabbit_queues(url: str) -> Iterator[list[str]]:
    """A queue with a 2-day message TTL and one without, deleted afterwards."""
    connection: Any = pika.BlockingConnection(pika.URLParameters(url))
    names = [f"cdd-prune-{uuid.uuid4().hex[:10]}" for _ in range(2)]
    channel = connection.channel()
    channel.queue_declare(names[0], arguments={"x-message-ttl": 2 * 86_400_000})
    channel.queue_declare(names[1])
    try:
        yield names
    finally:
        for name in names:
            channel.queue_delete(name)
        connection.close()
