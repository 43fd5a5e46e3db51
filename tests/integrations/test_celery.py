"""IdempotentTask with a real Celery worker (prefork, two children) on RabbitMQ and on Redis,
its results in Redis, and PostgreSQL: a task delivered again after its child was SIGKILLed
between the COMMIT and the ack, or enqueued three times under one id, applies its writes
once; a permanent failure is recorded FAILED and replayed after a fix; a transient failure
goes through Celery's retry and is recorded once; unsafe settings stop the worker at start.

One worker per broker (the module fixture); queues, schemas and task ids are unique, so
xdist workers never share one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text

from consumerdedup import Tables, install
from consumerdedup.failed import Filters, list_failed
from tests.support import services
from tests.support.rabbitmq_service import rabbitmq_url

pytest.importorskip("celery")
from tests.integrations.celery_tasks import build

ROOT = Path(__file__).resolve().parents[2]
REDIS = "redis://127.0.0.1:6379/0"
DEADLINE = 60.0


def wait_for(condition: Callable[[], Any], what: str, deadline: float = DEADLINE) -> Any:
    end = time.monotonic() + deadline
    while not (found := condition()):
        assert time.monotonic() < end, f"not within {deadline:g} s: {what}"
        time.sleep(0.05)
    return found


def duplicates(log: Path, task_id: str) -> int:
    """The worker's DUPLICATE lines for ``task_id`` (IdempotentTask logs one per duplicate)."""
    return sum(
        1 for line in log.read_text().splitlines() if "DUPLICATE" in line and task_id in line
    )


@dataclass
class Service:
    env: dict[str, str]
    engine: Engine
    tables: Tables
    schema: str
    marks: Path
    app: Any
    tasks: dict[str, Any]
    log: Path

    def rows(self, order_id: str) -> list[tuple[Any, ...]]:
        with self.engine.connect() as conn:
            found = conn.execute(
                text(f"SELECT account, amount FROM {self.schema}.ledger WHERE account = :o"),
                {"o": order_id},
            )
            return [tuple(r) for r in found]

    def records(self, consumer: str, message_id: str) -> list[str]:
        with self.engine.connect() as conn:
            found = conn.execute(
                text(
                    f"SELECT outcome FROM {self.schema}.processed_events "
                    "WHERE consumer = :c AND message_id = :m"
                ),
                {"c": consumer, "m": message_id},
            )
            return [r[0] for r in found]


def environment(postgres_url: str, schema: str, marks: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "CDD_CELERY_SCHEMA": schema,
        "CDD_CELERY_MARKS": str(marks),
        "CDD_CELERY_QUEUE": f"cdd-celery-{uuid.uuid4().hex[:10]}",
        "CDD_CELERY_BROKER": rabbitmq_url(),
        "CDD_CELERY_BACKEND": REDIS,
        "CDD_CELERY_DB": postgres_url,
        **extra,
    }


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "celery", "-A", "tests.integrations.celery_tasks", "worker",
        "-P", "prefork", "-c", "2", "-Q", env["CDD_CELERY_QUEUE"],
        "-n", f"{env['CDD_CELERY_QUEUE']}@%h", "--without-gossip", "--without-mingle",
        "--without-heartbeat", "-l", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


@pytest.fixture(scope="module", params=["rabbitmq", "redis"])
def service(
    request: pytest.FixtureRequest, postgres_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One worker per broker: RabbitMQ (requeue on reject), Redis (kombu restores the
    unacked message on reject)."""
    if not services.answers("127.0.0.1", 6379):
        services.unavailable("no Redis on 127.0.0.1:6379 for Celery's results")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(postgres_url)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(
            text(f"CREATE TABLE {schema}.ledger (account TEXT, amount INTEGER, message_id TEXT)")
        )
    folder = tmp_path_factory.mktemp("celery")
    env = environment(postgres_url, schema, folder)
    if request.param == "redis":
        env["CDD_CELERY_BROKER"] = REDIS
    app, tasks = build(env)
    log = folder / "worker.log"
    worker = start_worker(env, log)
    try:
        wait_for(lambda: b" ready." in log.read_bytes() or worker.poll() is not None, "ready")
        assert worker.poll() is None, log.read_text()
        yield Service(env, engine, tables, schema, folder, app, tasks, log)
    finally:
        stop(worker)
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(env["CDD_CELERY_QUEUE"])
            conn.default_channel.queue_delete(env["CDD_CELERY_QUEUE"] + ".dlq")
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()


def test_killed_after_commit_before_ack_applies_once(service: Service) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    sent = service.tasks["charge"].apply_async((order, 5), {"crash": True})
    # the child dies right after COMMIT; the parent rejects the task (reject_on_worker_lost),
    # RabbitMQ delivers it again, and a new child answers DUPLICATE: the backend holds no
    # result of the killed run, so None
    assert sent.get(timeout=DEADLINE) is None
    wait_for(lambda: duplicates(service.log, sent.id) == 1, "the redelivery's DUPLICATE")
    assert b"WorkerLostError" in service.log.read_bytes()
    assert service.rows(order) == [(order, 5)]
    assert service.records("cdd.charge", sent.id) == ["processed"]


def test_killed_mid_task_rolls_back_and_the_redelivery_applies_once(service: Service) -> None:
    """SIGKILL inside the body, its write flushed and not committed (acks_late, the
    child's task rejected to the broker): the write is gone with the transaction, the
    redelivery runs the body again and commits it: one ledger row, one record."""
    order = f"o-{uuid.uuid4().hex[:8]}"
    sent = service.tasks["charge"].apply_async((order, 4), {"crash_mid": True})
    assert sent.get(timeout=DEADLINE) == {"order_id": order, "amount": 4}
    assert len(list(service.marks.glob(f"crash-mid-{order}.*"))) == 2  # killed, then ran
    assert service.rows(order) == [(order, 4)]
    assert service.records("cdd.charge", sent.id) == ["processed"]
    assert duplicates(service.log, sent.id) == 0  # nothing committed: not a duplicate


def test_one_id_enqueued_three_times_applies_once(service: Service) -> None:
    order, task_id = f"o-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    charge = service.tasks["charge"]
    for _ in range(3):
        charge.apply_async((order, 7), task_id=task_id)
    assert charge.AsyncResult(task_id).get(timeout=DEADLINE) == {"order_id": order, "amount": 7}
    wait_for(lambda: duplicates(service.log, task_id) == 2, "two duplicates")
    assert service.rows(order) == [(order, 7)]
    assert service.records("cdd.charge", task_id) == ["processed"]
    # the duplicates returned the first run's result, not None
    assert charge.AsyncResult(task_id).get(timeout=DEADLINE) == {"order_id": order, "amount": 7}


def test_twins_at_once_one_waits_then_answers_duplicate(service: Service) -> None:
    """Two deliveries of one task id run at once in two children: the second's claim waits
    on the first's uncommitted record, then answers DUPLICATE."""
    order, task_id = f"o-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    held = service.tasks["held"]
    held.apply_async((order,), task_id=task_id)
    held.apply_async((order,), task_id=task_id)
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE :table"
    )

    def claim_waits() -> bool:
        with service.engine.connect() as conn:
            like = {"table": f"%{service.schema}.processed_events%"}
            return bool(conn.execute(waiting, like).scalar())

    wait_for(claim_waits, "the twin's claim waiting on the first's record")
    (service.marks / f"release-{order}").touch()
    wait_for(lambda: duplicates(service.log, task_id) == 1, "the twin's DUPLICATE")
    assert held.AsyncResult(task_id).get(timeout=DEADLINE) == "held"
    assert service.rows(order) == [(order, 1)]
    assert service.records("cdd.held", task_id) == ["processed"]


def test_key_function_dedups_two_task_ids(service: Service) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    by_order = service.tasks["by_order"]
    first, second = by_order.delay(order, 3), by_order.delay(order, 3)
    first.get(timeout=DEADLINE), second.get(timeout=DEADLINE)
    assert service.rows(order) == [(order, 3)]
    assert service.records("cdd.by_order", f"order:{order}") == ["processed"]


def test_permanent_failure_recorded_listed_and_replayed(service: Service) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    declined = service.tasks["declined"]
    sent = declined.delay(order)
    with pytest.raises(Exception, match="card declined"):
        sent.get(timeout=DEADLINE)
    assert sent.state == "FAILURE"
    assert service.rows(order) == []  # the writes rolled back with the failure
    assert service.records("cdd.declined", sent.id) == ["failed"]
    listed = list_failed(service.engine, Filters(consumer="cdd.declined"), tables=service.tables)
    assert [r.message_id for r in listed.records] == [sent.id]
    table = f"{service.schema}.processed_events"
    shown = subprocess.run(
        [sys.executable, "-m", "consumerdedup", "failed", "list",
         "--db", service.env["CDD_CELERY_DB"], "--processed-events-table", table,
         "--consumer", "cdd.declined"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert sent.id in shown.stdout and "card declined" in shown.stdout, shown.stdout
    (service.marks / "fixed").touch()
    try:
        declined.replay(sent.id)  # its arguments from the result backend (result_extended)
        wait_for(lambda: service.records("cdd.declined", sent.id) == ["processed"], "replayed")
    finally:
        (service.marks / "fixed").unlink()
    assert service.rows(order) == [(order, 1)]


def test_transient_failure_retried_by_celery_recorded_once(service: Service) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    sent = service.tasks["flaky"].delay(order, 2)
    assert sent.get(timeout=DEADLINE) == "charged"
    assert len(list(service.marks.glob(f"flaky-{order}.*"))) == 3  # ran three times
    assert service.rows(order) == [(order, 1)]  # the two RETRYs wrote nothing
    assert service.records("cdd.flaky", sent.id) == ["processed"]


def test_retries_exhausted_is_failed(service: Service) -> None:
    order = f"o-{uuid.uuid4().hex[:8]}"
    sent = service.tasks["flaky"].delay(order, 99)
    with pytest.raises(Exception, match="retries exhausted"):
        sent.get(timeout=DEADLINE)
    assert len(list(service.marks.glob(f"flaky-{order}.*"))) == 6  # max_retries=5, then FAILED
    assert service.rows(order) == []
    assert service.records("cdd.flaky", sent.id) == ["failed"]


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            {"CDD_CELERY_UNSAFE": "acks_late,reject"},
            "'cdd.flaky', 'cdd.held': acks_late is off",
        ),
        (
            {"CDD_CELERY_BROKER": "redis://127.0.0.1:6379/0", "CDD_CELERY_VT": "30"},
            "a time limit of 60 s on a redis broker whose visibility_timeout is 30 s",
        ),
    ],
)
def test_unsafe_settings_refused_at_worker_start(
    postgres_url: str, tmp_path: Path, extra: dict[str, str], said: str
) -> None:
    if not services.answers("127.0.0.1", 6379):
        services.unavailable("no Redis on 127.0.0.1:6379")
    env = environment(postgres_url, "unused", tmp_path, **extra)
    log = tmp_path / "worker.log"
    worker = start_worker(env, log)
    try:
        code = worker.wait(DEADLINE)
    finally:
        stop(worker)
    said_in_log = log.read_text()
    if "acks_late" in said:
        assert "reject_on_worker_lost is off" in said_in_log
    assert code == 1, said_in_log
    assert "ConfigurationError" in said_in_log and said in said_in_log, said_in_log
    assert " ready." not in said_in_log


def test_no_time_limit_on_redis_or_sqs_is_refused(tmp_path: Path) -> None:
    """No worker needed: the rule itself, for each broker kind and setting."""
    from consumerdedup.integrations.celery_settings import unsafe_settings

    env = environment("postgresql://unused", "unused", tmp_path)
    app, tasks = build({**env, "CDD_CELERY_BROKER": "sqs://"})
    app.conf.task_time_limit = None
    [said] = unsafe_settings(app, tasks["charge"])
    assert said.startswith("no time limit on a sqs broker whose visibility_timeout is 1800 s")
    app.conf.task_time_limit = 1799
    assert unsafe_settings(app, tasks["charge"]) == []
    app.conf.broker_url = "amqp://guest:guest@127.0.0.1//"  # RabbitMQ has no such timeout
    app.conf.task_time_limit = None
    assert unsafe_settings(app, tasks["charge"]) == []


def replay_command(service: Service, *extra: str) -> subprocess.CompletedProcess[str]:
    """``consumerdedup failed replay`` as an operator runs it, the Celery app named."""
    table = f"{service.schema}.processed_events"
    return subprocess.run(
        [sys.executable, "-m", "consumerdedup", "failed", "replay",
         "--db", service.env["CDD_CELERY_DB"], "--processed-events-table", table, *extra],
        capture_output=True, text=True, cwd=ROOT, env=service.env, timeout=DEADLINE,
    )  # fmt: skip


def dead_letters(service: Service) -> list[Any]:
    """The task ids in the worker queue's DLQ, read and given back."""
    from kombu import Queue

    ids = []
    with service.app.connection_for_write() as conn:
        channel = conn.channel()
        dlq = Queue(service.env["CDD_CELERY_QUEUE"] + ".dlq", no_declare=True)(channel)
        taken = []
        try:
            while (message := dlq.get(no_ack=False)) is not None:
                taken.append(message)
                ids.append(message.headers["id"])
        except Exception:  # no such queue yet (RabbitMQ's 404, Redis's empty list)
            return []
        for message in taken:
            message.requeue()
    return ids


def test_failed_replay_cli_sends_the_dead_letter_again(service: Service) -> None:
    """FAILED -> the task message dead-lettered to QUEUE.dlq on the task's own broker ->
    after a fix, ``failed replay --celery-app`` forgets the record and sends it again:
    the worker runs it, its writes land once, the DLQ is empty. The broker's URL comes
    from the app; a --rabbitmq replay leaves a Celery letter in place and says why."""
    order = f"o-{uuid.uuid4().hex[:8]}"
    declined = service.tasks["declined"]
    queue = service.env["CDD_CELERY_QUEUE"]
    sent = declined.delay(order, token="s3cr3t-argument")
    with pytest.raises(Exception, match="card declined"):
        sent.get(timeout=DEADLINE)
    assert wait_for(lambda: sent.id in dead_letters(service), "the dead letter")
    if service.env["CDD_CELERY_BROKER"].startswith("amqp"):
        raw = replay_command(service, "--rabbitmq", service.env["CDD_CELERY_BROKER"],
                             "--queue", queue, "--consumer", "cdd.declined", "--yes")  # fmt: skip
        assert raw.returncode == 1, raw.stdout + raw.stderr
        assert "replay it with --celery-app" in raw.stdout, raw.stdout
        assert service.records("cdd.declined", sent.id) == ["failed"]  # not forgotten
    (service.marks / "fixed").touch()
    try:
        done = replay_command(service, "--celery-app", "tests.integrations.celery_tasks:app",
                              "--queue", queue, "--consumer", "cdd.declined", "--yes")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"replayed cdd.declined {sent.id}" in done.stdout, done.stdout
        assert "s3cr3t" not in done.stdout + done.stderr  # arguments are never printed
        wait_for(lambda: service.records("cdd.declined", sent.id) == ["processed"], "replayed")
    finally:
        (service.marks / "fixed").unlink()
    assert service.rows(order) == [(order, 1)]
    assert sent.id not in dead_letters(service)


def test_failed_replay_needs_the_celery_app(service: Service) -> None:
    """Without a broker option the command refuses (exit 2) before anything connects;
    a --celery-app that names no Celery app is a usage error too."""
    queue = service.env["CDD_CELERY_QUEUE"]
    bare = replay_command(service, "--queue", queue, "--yes")
    assert bare.returncode == 2 and "--celery-app" in bare.stderr, bare.stderr
    wrong = replay_command(service, "--celery-app", "tests.integrations.celery_tasks:build",
                           "--queue", queue, "--yes")  # fmt: skip
    assert wrong.returncode == 2, wrong.stderr
    assert "not a Celery app" in wrong.stderr, wrong.stderr
