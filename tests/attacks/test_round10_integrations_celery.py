"""Round 10 attacks on consumerdedup.celery.IdempotentTask through its public API (docs/
celery.md), run by Celery itself eagerly (``task_always_eager``, ``.apply()``: Celery's own
tracer, retry and result handling) against the real PostgreSQL.

Holes found here: a body calling ``self.retry()`` (Celery's documented retry) was recorded
FAILED, so the retried copy answered that FAILED record and the task never ran again; a
``key=`` function that raised or returned None failed the task with nothing recorded and
nothing dead-lettered (None even said "called directly"); ``self.retry()`` past
``max_retries`` put Celery's MaxRetriesExceededError text, which quotes the task's
arguments, in the error column and the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, text

from consumerdedup import InvalidMessage, Tables
from tests.attacks.round10_celery_tasks import build
from tests.conftest import Database
from tests.support import services
from tests.support.rabbitmq_service import rabbitmq_url

pytest.importorskip("celery")
from celery import Celery
from celery.exceptions import Ignore, Reject

from consumerdedup.celery import IdempotentTask

SECRET = "hunter2-Pa55word"
REDIS = "redis://127.0.0.1:6379/0"
DEADLINE = 30.0


def wait_for(condition: Callable[[], Any], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < end, f"not within {DEADLINE:g} s: {what}"
        time.sleep(0.02)


def claim_waits(pg: Database) -> int:
    """Sessions waiting on a lock of this test's processed_events (a twin's claim)."""
    with pg.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE :table"
                ),
                {"table": f"%{pg.tables.processed_events}%"},
            ).scalar_one()
        )


def rows_in(pg: Database, ledger: str) -> int:
    with pg.engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {ledger}")).scalar_one())


@dataclass
class Eager:
    app: Celery
    engine: Engine
    tables: Tables
    ledger: str

    def task(self, name: str, fn: Callable[..., Any], **options: Any) -> Any:
        """``fn(task, *args)`` as an IdempotentTask named ``name`` (unique per test)."""
        return self.app.task(
            name=name,
            base=IdempotentTask,
            bind=True,
            engine=self.engine,
            tables=self.tables,
            **options,
        )(fn)

    def write(self, task: Any, account: str) -> None:
        task.session.execute(
            text(f"INSERT INTO {self.ledger} (account, amount) VALUES (:a, 1)"), {"a": account}
        )

    def rows(self) -> list[str]:
        with self.engine.connect() as conn:
            return [r[0] for r in conn.execute(text(f"SELECT account FROM {self.ledger}"))]

    def records(self, consumer: str) -> list[tuple[str, str, str | None]]:
        with self.engine.connect() as conn:
            found = conn.execute(
                text(
                    f"SELECT message_id, outcome, error FROM {self.tables.processed_events} "
                    "WHERE consumer = :c"
                ),
                {"c": consumer},
            )
            return [(r[0], r[1], r[2]) for r in found]


@pytest.fixture
def eager(pg: Database) -> Iterator[Eager]:
    app = Celery(f"r10-{uuid.uuid4().hex[:8]}", broker="memory://", backend="cache+memory://")
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_always_eager=True,
        task_eager_propagates=False,
    )
    yield Eager(app, pg.engine, pg.tables, pg.create_ledger())


def unique(what: str) -> str:
    return f"r10.{what}.{uuid.uuid4().hex[:8]}"


def test_self_retry_in_the_body_retries_the_task_and_records_nothing_until_it_succeeds(
    eager: Eager,
) -> None:
    runs: list[int] = []

    def body(task: Any, account: str) -> str:
        eager.write(task, account)
        runs.append(task.request.retries)
        if len(runs) < 3:
            raise task.retry(countdown=0)
        return "charged"

    name = unique("retry")
    task = eager.task(name, body, max_retries=5)
    task_id = str(uuid.uuid4())
    result = task.apply(args=("acct-retry",), task_id=task_id)
    assert (result.state, result.result) == ("SUCCESS", "charged"), result.traceback
    assert runs == [0, 1, 2]
    assert eager.rows() == ["acct-retry"]  # the two retried runs rolled back
    assert eager.records(name) == [(task_id, "processed", None)]


def test_self_retry_past_max_retries_keeps_no_argument_in_the_record_or_the_log(
    eager: Eager, caplog: pytest.LogCaptureFixture
) -> None:
    def body(task: Any, account: str, password: str) -> None:
        eager.write(task, account)
        raise task.retry(countdown=0)

    name = unique("exhausted")
    task = eager.task(name, body, max_retries=1)
    task_id = str(uuid.uuid4())
    with caplog.at_level(logging.DEBUG):
        result = task.apply(args=("acct-x",), kwargs={"password": SECRET}, task_id=task_id)
    assert result.state == "FAILURE"
    [(found_id, outcome, error)] = eager.records(name)
    assert (found_id, outcome) == (task_id, "failed")
    assert error is not None and "retries exhausted" in error
    assert SECRET not in error
    assert SECRET not in caplog.text
    assert SECRET not in str(result.result)
    assert eager.rows() == []


def _raises(*args: Any, **kwargs: Any) -> str:
    raise ValueError(f"cannot key {args!r} {kwargs!r}")  # quotes the arguments


@pytest.mark.parametrize(
    "key",
    [
        _raises,
        lambda account, password: None,
        lambda account, password: "k" * 10_000,
        lambda account, password: "order\x00" + account,
        lambda account, password: 42,
    ],
    ids=["raises", "none", "10kb", "nul", "int"],
)
def test_a_key_function_without_a_usable_key_refuses_the_task_alone(
    eager: Eager, caplog: pytest.LogCaptureFixture, key: Callable[..., Any]
) -> None:
    """InvalidMessage (FAILED, the body never runs, nothing written), never a setup fault,
    never the arguments in a reason; the next task with a good key runs."""
    ran: list[str] = []

    def body(task: Any, account: str, password: str) -> None:
        ran.append(account)
        eager.write(task, account)

    name = unique("key")
    task = eager.task(name, body, key=key)
    with caplog.at_level(logging.DEBUG):
        result = task.apply(args=("acct-1",), kwargs={"password": SECRET})
    assert result.state == "FAILURE"
    assert isinstance(result.result, InvalidMessage), repr(result.result)
    assert ran == [] and eager.rows() == []
    assert eager.records(name) == []  # no usable key: nothing to record it under
    assert SECRET not in str(result.result)
    assert SECRET not in caplog.text

    good = eager.task(unique("good"), body, key=lambda account, password: f"acct:{account}")
    assert good.apply(args=("acct-2",), kwargs={"password": SECRET}).state == "SUCCESS"
    assert eager.rows() == ["acct-2"]


def test_delay_under_task_always_eager_runs_once_per_key(eager: Eager) -> None:
    def body(task: Any, account: str) -> str:
        eager.write(task, account)
        return account

    name = unique("eager")
    task = eager.task(name, body, key=lambda account: f"acct:{account}")
    first = task.delay("acct-e")
    second = task.delay("acct-e")
    assert (first.state, first.result) == ("SUCCESS", "acct-e")
    assert second.state == "SUCCESS"
    assert eager.rows() == ["acct-e"]
    assert [(m, o) for m, o, _ in eager.records(name)] == [("acct:acct-e", "processed")]


@pytest.mark.parametrize("how", ["swallow", "commit", "rollback"])
def test_a_body_that_ends_or_breaks_its_transaction_is_failed_with_nothing_written(
    eager: Eager, how: str
) -> None:
    def body(task: Any, account: str) -> str:
        eager.write(task, account)
        if how == "swallow":
            with contextlib.suppress(Exception):  # the attack: swallowed, and it returns
                task.session.execute(text("SELECT 1/0"))
        elif how == "commit":
            task.session.commit()
        else:
            task.session.rollback()
            eager.write(task, account + "-after")
        return "done"

    name = unique(how)
    task = eager.task(name, body)
    task_id = str(uuid.uuid4())
    result = task.apply(args=("acct-b",), task_id=task_id)
    assert result.state == "FAILURE"
    assert eager.rows() == []
    assert [(m, o) for m, o, _ in eager.records(name)] == [(task_id, "failed")]


class _Seen(logging.Handler):
    """Sets ``event`` when IdempotentTask logs a DUPLICATE (its public INFO line)."""

    def __init__(self, event: threading.Event) -> None:
        super().__init__(logging.INFO)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        if "DUPLICATE" in record.getMessage():
            self.event.set()


def test_a_twin_racing_the_first_run_never_replaces_its_stored_result(pg: Database) -> None:
    """Two runs of one task id at once (a redelivery racing the original): the twin's claim
    waits, answers DUPLICATE once the first COMMITs, and then must return (and store) the
    first run's result, not None. The first run stores its result only after the twin has
    answered (held in its after_commit), the window in which the twin used to read nothing
    and store None over it. Results in the real Redis."""
    if not services.answers("127.0.0.1", 6379):
        services.unavailable("no Redis on 127.0.0.1:6379 for Celery's results")
    app = Celery(f"r10-{uuid.uuid4().hex[:8]}", broker="memory://", backend=REDIS)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_store_eager_result=True,
        task_eager_propagates=False,
    )
    ledger = pg.create_ledger()
    started, release, duplicate = threading.Event(), threading.Event(), threading.Event()
    seen = _Seen(duplicate)
    logging.getLogger("consumerdedup.celery").addHandler(seen)
    previous = logging.getLogger("consumerdedup.celery").level
    logging.getLogger("consumerdedup.celery").setLevel(logging.INFO)

    def held(task: Any, account: str) -> dict[str, str]:
        task.session.execute(
            text(f"INSERT INTO {ledger} (account, amount) VALUES (:a, 1)"), {"a": account}
        )
        started.set()
        assert release.wait(DEADLINE), "never released"
        # the twin answers between this COMMIT and the tracer storing this result
        event.listen(task.session, "after_commit", lambda _: duplicate.wait(DEADLINE))
        return {"first": account}

    name = unique("twins")
    task = app.task(name=name, base=IdempotentTask, bind=True, engine=pg.engine, tables=pg.tables)(
        held
    )
    task_id = str(uuid.uuid4())
    results: dict[str, Any] = {}

    def run(which: str) -> None:
        results[which] = task.apply(args=("acct-t",), task_id=task_id)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    twin = threading.Thread(target=run, args=("twin",))
    try:
        assert started.wait(DEADLINE), "the first run's body never started"
        twin.start()
        wait_for(lambda: claim_waits(pg) > 0, "the twin's claim waiting on the first's")
        release.set()
        first.join(DEADLINE)
        twin.join(DEADLINE)
    finally:
        release.set()
        duplicate.set()
        logging.getLogger("consumerdedup.celery").removeHandler(seen)
        logging.getLogger("consumerdedup.celery").setLevel(previous)
    assert not first.is_alive() and not twin.is_alive()
    assert results["first"].result == {"first": "acct-t"}
    assert results["twin"].result == {"first": "acct-t"}, "the twin returned another result"
    assert app.AsyncResult(task_id).get(timeout=DEADLINE) == {"first": "acct-t"}
    assert rows_in(pg, ledger) == 1
    with pg.engine.connect() as conn:
        outcome = conn.execute(
            text(f"SELECT outcome FROM {pg.tables.processed_events} WHERE consumer = :c"),
            {"c": name},
        ).scalar_one()
    assert outcome == "processed"


def test_a_body_raising_ignore_is_done_its_writes_commit_once(eager: Eager) -> None:
    """Celery acks an ignored task without a state (``self.replace()`` raises Ignore): acked,
    so done, so its writes commit with the record; it was FAILED with its writes undone."""

    def body(task: Any, account: str) -> None:
        eager.write(task, account)
        raise Ignore()

    name = unique("ignore")
    task = eager.task(name, body)
    task_id = str(uuid.uuid4())
    assert task.apply(args=("acct-i",), task_id=task_id).state == "IGNORED"
    assert task.apply(args=("acct-i",), task_id=task_id).state == "SUCCESS"  # a DUPLICATE
    assert eager.rows() == ["acct-i"]
    assert eager.records(name) == [(task_id, "processed", None)]


def test_a_body_rejecting_itself_with_requeue_records_nothing_and_runs_again(
    eager: Eager,
) -> None:
    """``raise Reject(requeue=True)``: delivered again, so RETRY (rolled back, nothing
    recorded); it was FAILED, so the requeued copy answered that record and never ran."""
    runs: list[int] = []

    def body(task: Any, account: str) -> str:
        eager.write(task, account)
        runs.append(1)
        if len(runs) == 1:
            raise Reject("not now", requeue=True)
        return "ran"

    name = unique("reject")
    task = eager.task(name, body)
    task_id = str(uuid.uuid4())
    assert task.apply(args=("acct-r",), task_id=task_id).state == "REJECTED"
    assert eager.rows() == [] and eager.records(name) == []
    again = task.apply(args=("acct-r",), task_id=task_id)  # the requeued copy
    assert (again.state, again.result) == ("SUCCESS", "ran")
    assert eager.rows() == ["acct-r"]
    assert eager.records(name) == [(task_id, "processed", None)]


def test_a_body_rejecting_itself_for_good_is_failed_with_nothing_written(eager: Eager) -> None:
    def body(task: Any, account: str) -> None:
        eager.write(task, account)
        raise Reject("bad order", requeue=False)

    name = unique("reject-for-good")
    task = eager.task(name, body, max_retries=3)
    task_id = str(uuid.uuid4())
    task.apply(args=("acct-f",), task_id=task_id)
    assert eager.rows() == []
    assert [(m, o) for m, o, _ in eager.records(name)] == [(task_id, "failed")]


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def worker(pg: Database, tmp_path: Path) -> Iterator[tuple[dict[str, str], Any, dict[str, Any]]]:
    """A real ``celery worker`` (solo pool) on RabbitMQ, results in Redis, PostgreSQL."""
    if not services.answers("127.0.0.1", 6379):
        services.unavailable("no Redis on 127.0.0.1:6379 for Celery's results")
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {pg.schema}.ledger (account TEXT, amount INTEGER)"))
    env = {
        **os.environ,
        "R10_CELERY_SCHEMA": str(pg.schema),
        "R10_CELERY_MARKS": str(tmp_path),
        "R10_CELERY_QUEUE": f"r10-celery-{uuid.uuid4().hex[:10]}",
        "R10_CELERY_BROKER": rabbitmq_url(),
        "R10_CELERY_BACKEND": REDIS,
        "R10_CELERY_DB": pg.url,
    }
    app, tasks = build(env)
    log = tmp_path / "worker.log"
    command = [
        sys.executable, "-m", "celery", "-A", "tests.attacks.round10_celery_tasks", "worker",
        "-P", "solo", "-Q", env["R10_CELERY_QUEUE"], "-n", f"{env['R10_CELERY_QUEUE']}@%h",
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO",
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=out)
    try:
        wait_for(lambda: b" ready." in log.read_bytes() or process.poll() is not None, "ready")
        assert process.poll() is None, log.read_text()
        yield env, app, tasks
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        assert SECRET not in log.read_text(), "a task argument reached the worker's log"
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(env["R10_CELERY_QUEUE"])
            conn.default_channel.queue_delete(env["R10_CELERY_QUEUE"] + ".dlq")


def _dlq_depth(app: Any, queue: str) -> int:
    with app.connection_for_write() as conn:
        try:
            return int(conn.channel().queue_declare(queue + ".dlq", passive=True).message_count)
        except Exception:  # no such queue: nothing was dead-lettered
            return 0


def test_a_worker_runs_a_body_that_calls_self_retry_once_nothing_failed(
    worker: tuple[dict[str, str], Any, dict[str, Any]], pg: Database
) -> None:
    env, app, tasks = worker
    sent = tasks["retrying"].delay("acct-w")
    assert sent.get(timeout=DEADLINE) == "charged after 2 retries"
    with pg.engine.connect() as conn:
        accounts = conn.execute(text(f"SELECT account FROM {pg.schema}.ledger")).all()
        found = conn.execute(
            text(f"SELECT message_id, outcome FROM {pg.tables.processed_events}")
        ).all()
    assert [a for (a,) in accounts] == ["acct-w"]
    assert [tuple(r) for r in found] == [(sent.id, "processed")]
    assert _dlq_depth(app, env["R10_CELERY_QUEUE"]) == 0


def test_a_worker_dead_letters_a_task_its_key_refuses_and_replay_prints_no_argument(
    worker: tuple[dict[str, str], Any, dict[str, Any]], pg: Database
) -> None:
    env, app, tasks = worker
    sent = tasks["unkeyable"].delay("acct-k", password=SECRET)
    with pytest.raises(Exception, match="key function raised ValueError"):
        sent.get(timeout=DEADLINE)
    wait_for(lambda: _dlq_depth(app, env["R10_CELERY_QUEUE"]) == 1, "the dead letter")
    replay = subprocess.run(
        [sys.executable, "-m", "consumerdedup", "failed", "replay", "--db", pg.url,
         "--processed-events-table", str(pg.tables.processed_events),
         "--celery-app", "tests.attacks.round10_celery_tasks:app",
         "--queue", env["R10_CELERY_QUEUE"], "--yes", "--verbose"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=DEADLINE,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"r10.unkeyable {sent.id}" in replay.stdout, replay.stdout
    assert SECRET not in replay.stdout + replay.stderr
    # sent back, refused again by its key, dead-lettered again: never applied
    wait_for(lambda: _dlq_depth(app, env["R10_CELERY_QUEUE"]) == 1, "dead-lettered again")
    with pg.engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {pg.schema}.ledger")).scalar() == 0
