"""The admin pages served by ``consumerdedup run``'s supervisor (``app.admin(...)`` and
``--admin-port``), through a real run (tests/worker/admin_service.py) on the real
PostgreSQL and RabbitMQ and a real HTTP client: only the supervisor listens, not a worker
child; the app's authorize decides who sees and who acts; an operator replays the message
a bad deploy failed and it is processed; SIGTERM closes the port. Deny by default: no
authorize and no token, or a bind off loopback without a token, is refused at start
(exit 2); a token alone serves read-only pages to its holder."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, text

from consumerdedup import Tables, install
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run, wait_for

APP = "tests.worker.admin_service:app"
ADMIN = re.compile(r"admin pages on http://127\.0\.0\.1:(\d+)/")
TOKEN = "t0ken-" + "x" * 20


@pytest.fixture
def schema(postgres_url: str) -> Iterator[str]:
    name = f"admin_{uuid.uuid4().hex[:10]}"
    engine = create_engine(postgres_url)
    install(engine, Tables.define(f"{name}.processed_events", f"{name}.outbox"))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name}.ledger (message_id TEXT)"))
    yield name
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
    engine.dispose()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def start(runs: list[Run], args: list[str], **env: str) -> Run:
    run = Run([APP, *args], env)
    runs.append(run)
    return run


def admin_port(run: Run) -> int:
    def found() -> int | None:
        assert run.process.poll() is None, f"exited early:\n{run.stderr}"
        match = ADMIN.search(run.stderr)
        return int(match[1]) if match else None

    return wait_for(found, 60, "the admin port in the log")


def query(url: str, sql: str) -> list[tuple[object, ...]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(sql))]
    finally:
        engine.dispose()


def listeners(port: int) -> set[int]:
    """The pids holding the listening socket of ``port`` (from /proc: its inode)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    holders = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = {os.readlink(fd) for fd in (entry / "fd").iterdir()}
        except OSError:  # gone, or not ours to read
            continue
        if any(f"socket:[{inode}]" in links for inode in inodes):
            holders.add(int(entry.name))
    return holders


def test_the_supervisor_serves_the_pages_and_an_operator_replays_a_failed_message(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, tmp_path: Path,
    runs: list[Run],
) -> None:  # fmt: skip
    queue = rabbit.queue("shop")
    fixed = tmp_path / "fixed"
    env = {"CONSUMERDEDUP_DATABASE_URL": postgres_url, "CONSUMERDEDUP_RABBITMQ_URL": amqp_url,
           "ADMIN_QUEUE": queue, "ADMIN_SCHEMA": schema, "ADMIN_FIXED": str(fixed),
           "ADMIN_DECLARE": "1"}  # fmt: skip
    run = start(runs, ["--workers", "2", "--health-port", "0", "--admin-port", "0"], **env)
    port = admin_port(run)
    wait_for(lambda: run.status("/readyz") == 200, 120, "ready")
    assert listeners(port) == {run.process.pid}  # the supervisor only, no worker child
    assert len(run.child_pids()) == 2 and len(ADMIN.findall(run.stderr)) == 1
    rabbit.publish(queue, b"bad", message_id="order-1")
    rabbit.publish(queue, b"{}", message_id="order-2")
    pe = f"{schema}.processed_events"
    wait_for(lambda: len(query(postgres_url, f"SELECT 1 FROM {pe}")) == 2, 60, "both decided")
    assert rabbit.reaches(queue + ".dlq", 1) == 1
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(base_url=base, timeout=10) as anonymous:
        assert anonymous.get("/failures.json").status_code == 403  # authorize said None
    with httpx.Client(base_url=base, timeout=10, headers={"x-user": "viewer"}) as viewer:
        seen = viewer.get("/failures.json").json()
        assert [r["message_id"] for r in seen["records"]] == ["order-1"]
        assert seen["role"] == "viewer" and seen["can_act"] is False
        form = {"action": "forget", "scope": "selected", "key": json.dumps(["ledger", "order-1"]),
                "csrf": seen["csrf"], "confirm": "yes", "why": "try"}  # fmt: skip
        refused = viewer.post("/failures/apply", data=form)
        assert refused.status_code == 403 and "only an operator may act" in refused.text
    fixed.touch()  # the fix is deployed
    with httpx.Client(base_url=base, timeout=10, headers={"x-user": "ops"}) as ops:
        csrf = ops.get("/failures.json").json()["csrf"]
        form = {"action": "replay", "scope": "selected", "key": json.dumps(["ledger", "order-1"]),
                "csrf": csrf, "confirm": "yes", "why": "sku fixed"}  # fmt: skip
        done = ops.post("/failures/apply", data=form)
        assert done.status_code == 200 and "Replayed" in done.text
    wait_for(
        lambda: (
            query(postgres_url, f"SELECT outcome FROM {pe} WHERE message_id = 'order-1'")
            == [("processed",)]
        ),
        60,
        "order-1 processed after the replay",
    )
    ledger = {m for (m,) in query(postgres_url, f"SELECT message_id FROM {schema}.ledger")}
    assert ledger == {"order-1", "order-2"}
    assert '"action": "failed.replay"' in run.stderr and "ops@example.com" in run.stderr
    run.signal(signal.SIGTERM)
    assert run.wait(60) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_pages_open_to_anyone_are_refused_at_start(
    postgres_url: str, schema: str, runs: list[Run]
) -> None:
    env = {"CONSUMERDEDUP_DATABASE_URL": postgres_url, "ADMIN_SCHEMA": schema}
    bare = start(runs, ["--admin-port", "0"], **env)  # no app.admin(...), no token
    assert bare.wait(60) == 2
    assert "the admin pages need to know who may see them" in bare.stderr
    wide = start(runs, ["--admin-port", "0", "--admin-host", "0.0.0.0"], ADMIN_DECLARE="1",
                 CONSUMERDEDUP_RABBITMQ_URL="amqp://guest:guest@127.0.0.1/", **env)  # fmt: skip
    assert wide.wait(60) == 2
    assert "admin host 0.0.0.0 is not loopback: set CONSUMERDEDUP_ADMIN_TOKEN" in wide.stderr
    short = start(
        runs, ["--admin-port", "0", "--check"], CONSUMERDEDUP_ADMIN_TOKEN="tooShort7", **env
    )
    assert short.wait(60) == 2
    assert "expected a token of at least 16 characters" in short.stderr
    assert "tooShort7" not in short.stderr  # a secret is never quoted


def test_a_token_alone_serves_read_only_pages_to_its_holder(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    env = {"CONSUMERDEDUP_DATABASE_URL": postgres_url, "CONSUMERDEDUP_RABBITMQ_URL": amqp_url,
           "ADMIN_QUEUE": rabbit.queue("shop"), "ADMIN_SCHEMA": schema,
           "CONSUMERDEDUP_ADMIN_TOKEN": TOKEN, "CONSUMERDEDUP_ADMIN_PORT": "1"}  # fmt: skip
    run = start(runs, ["--admin-port", "0"], **env)  # the flag beats the variable
    port = admin_port(run)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        assert client.get("/failures.json").status_code == 401
        wrong = client.get("/failures.json", headers={"authorization": "Bearer " + "y" * 26})
        assert wrong.status_code == 401
        seen = client.get("/failures.json", headers={"authorization": "Bearer " + TOKEN})
        assert seen.status_code == 200 and seen.json()["can_act"] is False
    assert TOKEN not in run.stderr
