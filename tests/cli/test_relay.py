"""``consumerdedup relay`` end to end: a real database, a real RabbitMQ, a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from sqlalchemy.orm import Session

from consumerdedup import Outbox
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def relay_command(db: Any, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "consumerdedup",
        "relay",
        "--db",
        db.url,
        "--processed-events-table",
        db.tables.processed_events.fullname,
        "--outbox-table",
        db.tables.outbox.fullname,
        *args,
    ]


def add(db: Any, queue: str, count: int) -> list[str]:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        return [outbox.add(session, queue, f"e{n}".encode(), key="k") for n in range(count)]


def test_relay_once_publishes_the_backlog_and_exits(db: Any, rabbit: Broker, amqp_url: str) -> None:
    queue = rabbit.queue("cli")
    ids = add(db, queue, 25)
    done = subprocess.run(
        relay_command(db, "--rabbitmq", amqp_url, "--once", "--batch-size", "10"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "published 25 event(s); 0 waiting" in done.stdout
    assert "guest:guest" not in done.stdout + done.stderr
    assert [p.message_id for p, _ in rabbit.peek(queue)] == ids


def test_relay_runs_until_sigterm_and_exits_zero(pg: Any, rabbit: Broker, amqp_url: str) -> None:
    queue = rabbit.queue("cli")
    process = subprocess.Popen(
        relay_command(pg, "--rabbitmq", amqp_url, "--poll", "5s"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert process.stdout is not None
        assert "relay running" in process.stdout.readline()
        ids = add(pg, queue, 5)  # NOTIFY wakes it well before the 5 s poll
        deadline = time.monotonic() + 20
        while rabbit.ready(queue) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.message_id for p, _ in rabbit.peek(queue)] == ids
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err


def test_relay_bad_input_is_one_line_and_exit_2(sqlite_db: Any) -> None:
    for args in (
        ["--batch-size", "0", "--rabbitmq", "amqp://x"],
        [],
        ["--kafka", "a:1", "--poll", "soon"],
    ):
        done = subprocess.run(relay_command(sqlite_db, *args), capture_output=True, text=True)
        assert done.returncode == 2, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "Traceback" not in done.stderr


def test_the_old_spellings_amqp_and_batch_still_work_with_a_warning(
    db: Any, rabbit: Broker, amqp_url: str
) -> None:
    queue = rabbit.queue("cli")
    ids = add(db, queue, 3)
    done = subprocess.run(
        relay_command(db, "--amqp", amqp_url, "--once", "--batch", "2"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--amqp is deprecated, use --rabbitmq" in done.stderr
    assert "--batch is deprecated, use --batch-size" in done.stderr
    assert "guest:guest" not in done.stdout + done.stderr
    assert [p.message_id for p, _ in rabbit.peek(queue)] == ids
