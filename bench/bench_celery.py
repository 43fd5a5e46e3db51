"""IdempotentTask's cost per task against the same Celery task without it, through a real
worker.

Run: ``.venv/bin/python bench/bench_celery.py`` (``--tasks N``, ``--rounds N`` at least 3,
``--concurrency N``; ``--quick``: a smoke run). Needs PostgreSQL
(``CONSUMERDEDUP_BENCH_PG_URL``) and RabbitMQ (``CONSUMERDEDUP_BENCH_AMQP_URL``) as the
broker; its schema and queues are fresh and removed at the end.

The workload: one ``celery worker`` (prefork, ``--concurrency`` children, acks_late,
reject_on_worker_lost, prefetch multiplier 4, no result backend) running bench/
celery_bench_app.py's two tasks, each inserting one row on PostgreSQL (psycopg 3):

- plain: the task opens its own transaction (``with engine.begin()``), as a Celery user
  writes it without this library (nothing stops a redelivery applying twice);
- IdempotentTask: the same insert on ``self.session``; the claim, the insert and the
  record commit together, before the ack.

Each round: N tasks are sent (untimed) to a fresh queue the worker does not consume;
then the worker is told to consume it (``add_consumer``), and the figure is N over the
time from that call until the table holds N rows (polled every 5 ms), as tasks a second.
Configurations alternate round by round on the same worker; a figure is the median of
the rounds, a ratio the ratio of medians. Checks (a miss exits 1): N rows each round,
and IdempotentTask's N processed records.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.measure import Conditions, Series, add_round_arguments, check_rounds, print_table
from consumerdedup import Tables, install

ROOT = Path(__file__).resolve().parents[1]
PG = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
DEADLINE = 600.0


def wait_for(condition: Callable[[], object], what: str) -> None:
    end = time.monotonic() + DEADLINE
    while not condition():
        if time.monotonic() > end:
            raise SystemExit(f"BENCH FAILED: not within {DEADLINE:g} s: {what}")
        time.sleep(0.005)


def rows(engine: Engine, schema: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {schema}.rows")).scalar() or 0)


def main(args: argparse.Namespace) -> int:
    schema = f"bench_celery_{uuid.uuid4().hex[:8]}"
    engine = create_engine(PG)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.rows (n INTEGER)"))
    os.environ.update(CDD_BENCH_BROKER=AMQP, CDD_BENCH_SCHEMA=schema, CDD_BENCH_DB=PG)
    from bench.celery_bench_app import app, dedup, plain  # configured by the variables

    idle = f"bench-celery-idle-{uuid.uuid4().hex[:8]}"
    node = f"{idle}@bench"
    log = Path(f"/tmp/{idle}.log")
    command = [
        sys.executable, "-m", "celery", "-A", "bench.celery_bench_app", "worker",
        "-P", "prefork", "-c", str(args.concurrency), "-Q", idle, "-n", node,
        "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "WARNING",
    ]  # fmt: skip
    conditions = Conditions()
    conditions.postgres(engine)
    conditions.add(
        "Celery",
        f"a real worker, prefork, {args.concurrency} children, acks_late, prefetch x4, "
        "no result backend; RabbitMQ 127.0.0.1:5672 as the broker",
    )
    conditions.add("workload", f"{args.tasks:,} tasks a round, one transaction each")
    conditions.print()
    with log.open("wb") as out:
        worker = subprocess.Popen(command, cwd=ROOT, env=os.environ, stdout=out, stderr=out)
    series = {"plain": Series("plain Celery task"), "dedup": Series("IdempotentTask")}
    failed = False
    queues: list[str] = []
    try:
        wait_for(lambda: app.control.ping([node], timeout=0.5) or worker.poll() is not None,
                 "the worker answers")  # fmt: skip
        if worker.poll() is not None:
            raise SystemExit(f"BENCH FAILED: the worker exited:\n{log.read_text()}")
        for _ in range(args.rounds):
            for name, task in (("plain", plain), ("dedup", dedup)):
                with engine.begin() as conn:
                    conn.execute(text(f"TRUNCATE {schema}.rows"))
                queue = f"bench-celery-{name}-{uuid.uuid4().hex[:8]}"
                queues.append(queue)
                with app.producer_or_acquire() as producer:
                    for i in range(args.tasks):
                        task.apply_async((i,), queue=queue, producer=producer)

                started = time.perf_counter()
                app.control.add_consumer(queue, destination=[node], reply=True, timeout=10)
                wait_for(lambda: rows(engine, schema) >= args.tasks, f"{args.tasks} rows ({name})")
                series[name].add(args.tasks / (time.perf_counter() - started))
                app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=10)
                if (found := rows(engine, schema)) != args.tasks:
                    print(f"BENCH FAILED: {name}: {found} rows, expected {args.tasks}")
                    failed = True
        with engine.connect() as conn:
            records = conn.execute(
                text(f"SELECT count(*) FROM {schema}.processed_events WHERE outcome = 'processed'")
            ).scalar()
        if records != args.tasks * args.rounds:
            print(f"BENCH FAILED: {records} records, expected {args.tasks * args.rounds}")
            failed = True
        plain_s, dedup_s = series["plain"], series["dedup"]
        print_table(f"Celery worker, {args.tasks} tasks", [plain_s, dedup_s], plain_s)
        per_task = (1 / dedup_s.median - 1 / plain_s.median) * 1e6
        ratio = dedup_s.ratio(plain_s)
        print(f"IdempotentTask / plain: {ratio:.2f}x; cost {per_task:,.0f} us a task")
        conditions.print_after()
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        with app.connection_for_write() as conn:
            for queue in [*queues, idle]:
                conn.default_channel.queue_delete(queue)
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()
        log.unlink(missing_ok=True)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=2)
    add_round_arguments(parser)
    parsed = parser.parse_args()
    check_rounds(parser, parsed)
    if parsed.quick:
        parsed.tasks = 200
    sys.exit(main(parsed))
