"""``consumerdedup run`` over a real App and runner (tests/worker/ledger_service.py) on the real
PostgreSQL and RabbitMQ: a hanging handler fails /livez, a missing table exits 1 with the fix,
a database away at start keeps /readyz at 503 until it comes back, --check."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from consumerdedup import Tables, install
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run, wait_for
from tests.support.tcp_proxy import Proxy

APP = "tests.worker.ledger_service:app"


@pytest.fixture
def schema(postgres_url: str) -> Iterator[str]:
    name = f"ledger_{uuid.uuid4().hex[:10]}"
    yield name
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
    engine.dispose()


def install_tables(postgres_url: str, schema: str) -> None:
    engine = create_engine(postgres_url)
    install(engine, Tables.define(f"{schema}.processed_events", f"{schema}.outbox"))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.ledger (message_id TEXT)"))
    engine.dispose()


def applied(postgres_url: str, schema: str) -> int:
    engine = create_engine(postgres_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {schema}.ledger")).scalar() or 0)
    finally:
        engine.dispose()


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    """Named last by the tests: stopped first, before their schema and queue are dropped."""
    started: list[Run] = []
    yield started
    for run in started:
        run.stop()


def env(url: str, amqp_url: str, queue: str, schema: str) -> dict[str, str]:
    return {"CONSUMERDEDUP_DATABASE_URL": url, "CONSUMERDEDUP_RABBITMQ_URL": amqp_url,
            "LEDGER_QUEUE": queue, "LEDGER_SCHEMA": schema}  # fmt: skip


def test_a_handler_that_hangs_fails_livez(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    install_tables(postgres_url, schema)
    queue = rabbit.queue("ledger")
    run = Run([APP, "--health-port", "0", "--liveness-timeout", "2", "--shutdown-timeout", "3"],
              env(postgres_url, amqp_url, queue, schema))  # fmt: skip
    runs.append(run)
    wait_for(lambda: run.status("/readyz") == 200, 120, "ready")
    rabbit.publish(queue, b"{}", message_id="m-1")
    wait_for(lambda: applied(postgres_url, schema) == 1, 60, "m-1 applied")
    assert run.status("/livez") == 200  # and an idle loop goes on ticking
    rabbit.publish(queue, b"hang", message_id="m-2")
    wait_for(lambda: run.status("/livez") == 503, 60, "livez failing")
    _, body = run.get("/livez")
    assert "ledger: its loop has not turned" in body["workers"][0]["why"]


def test_a_missing_table_exits_1_with_the_fix(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    run = Run([APP], env(postgres_url, amqp_url, rabbit.queue("ledger"), schema))
    runs.append(run)
    assert run.wait(120) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("consumerdedup: error: ledger: ConfigurationError")
    assert f"{schema}.processed_events" in last and "init-db" in last
    assert "restarting" not in run.stderr


def test_a_missing_queue_exits_1_with_the_fix(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    install_tables(postgres_url, schema)
    run = Run([APP], env(postgres_url, amqp_url, rabbit.name("never-declared"), schema))
    runs.append(run)
    assert run.wait(120) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("consumerdedup: error: ledger: TopologyError: cannot consume")
    assert "declare it, or set RabbitConfig(declare=True)" in last
    assert "restarting" not in run.stderr  # a setup fault: restarting cannot fix it


def test_a_database_away_at_start_is_waited_for(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    install_tables(postgres_url, schema)
    url = make_url(postgres_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or 5432)
    proxy.cut()  # the database is away: connections refused
    away = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    queue = rabbit.queue("ledger")
    run = Run([APP, "--health-port", "0"], env(away, amqp_url, queue, schema))
    runs.append(run)

    def waiting() -> bool:
        # The runner waits out the outage inside run(): running, not ready, saying why.
        status, body = run.get("/readyz")
        part = (body["workers"][0].get("parts") or {}).get("ledger")
        return status == 503 and part is not None and "OperationalError" in str(part["error"])

    wait_for(waiting, 30, "the part waiting for its database")
    _, body = run.get("/readyz")
    assert body["workers"][0]["parts"]["ledger"]["ready"] is False
    assert run.status("/livez") == 200 and run.process.poll() is None
    proxy.restore()
    wait_for(lambda: run.status("/readyz") == 200, 120, "ready once the database is back")
    rabbit.publish(queue, b"{}", message_id="m-1")
    wait_for(lambda: applied(postgres_url, schema) == 1, 60, "m-1 applied")
    run.signal(signal.SIGTERM)
    assert run.wait(60) == 0, run.stderr


def test_check_runs_the_apps_checks(
    postgres_url: str, amqp_url: str, rabbit: Broker, schema: str, runs: list[Run]
) -> None:
    queue = rabbit.queue("ledger")
    missing = Run([APP, "--check"], env(postgres_url, amqp_url, queue, schema))
    runs.append(missing)
    assert missing.wait(120) == 1
    out = missing.process.stdout.read().decode()  # type: ignore[union-attr]
    assert "FAIL" in out and "fix:" in out and "init-db" in out
    install_tables(postgres_url, schema)
    ready = Run([APP, "--check"], env(postgres_url, amqp_url, queue, schema))
    runs.append(ready)
    assert ready.wait(120) == 0, ready.stderr
    out = ready.process.stdout.read().decode()  # type: ignore[union-attr]
    assert "FAIL" not in out and ", 0 failing" in out
    assert rabbit.held(queue) == 0  # consumed nothing
