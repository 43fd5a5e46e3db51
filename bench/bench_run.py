"""``consumerdedup run``'s cost per message against the same runner started by hand.

Run: ``.venv/bin/python bench/bench_run.py`` (``--messages N``, ``--rounds N`` at least 3;
``--quick``: a smoke run). Needs PostgreSQL (``CONSUMERDEDUP_BENCH_PG_URL``) and RabbitMQ
(``CONSUMERDEDUP_BENCH_AMQP_URL``); its schema and queue are fresh and removed at the end.

The workload (bench/run_service.py): a RabbitMQ consumer, ``batch_size`` 100, prefetch 200,
a per-message handler inserting one row through the Session; N messages published
beforehand (untimed), each id once. Configurations, each a process of its own:

- by hand (bench/run_by_hand.py): the same function wrapped by a Deduplicator, a
  RabbitConsumerRunner with the same config, ``runner.run()`` on the main thread;
- ``consumerdedup run run_service:app`` (one worker): the supervisor, a child that loads
  the App and runs the part in a thread, reporting twice a second; no probes;
- the same with ``--health-port 0``: the probes served, and the child counting outcomes
  and batch times into prometheus_client's multiprocess files (the hook on every batch).

The figure is the consuming time: from the first batch's transaction to the last's
(processed_events.processed_at, the server's clock; start-up, imports and the connection
excluded, the same for every configuration), as messages a second. Per round each
configuration drains its own fresh N messages, round-robin; a figure is the median of the
rounds, a ratio the ratio of medians (bench/measure.py). The overhead per message is
(1/rate_run - 1/rate_by_hand), in microseconds. Beside the rate, the CPU the configuration's
processes (the supervisor and its child, or the one process by hand; read from /proc) spent
a message over the same span: on a machine others load, the rate swings with them, the CPU
a message much less. Target: ``run`` within 5% of by hand.

Last, the worker's only code on the message path, its metrics hook (once a batch, with
``--health-port``), timed alone in process: what it adds a message without the runs' noise.

Checks (a miss exits 1): every message applied once (rows == distinct ids == N), the queue
empty afterwards, every process exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pika
from sqlalchemy import create_engine, text

from consumerdedup import Tables, install

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from measure import Conditions, Series, add_round_arguments, check_rounds, print_pairs, print_table  # noqa: E402

AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
BY_HAND = "runner started by hand"
RUN = "consumerdedup run, 1 worker"
RUN_PROBES = "consumerdedup run, 1 worker, --health-port (metrics)"
RUN_COMMAND = [sys.executable, "-m", "consumerdedup", "run", "run_service:app"]
COMMANDS = {
    BY_HAND: [sys.executable, str(HERE / "run_by_hand.py")],
    RUN: [*RUN_COMMAND, "--log-level", "WARNING"],
    RUN_PROBES: [*RUN_COMMAND, "--log-level", "WARNING", "--health-port", "0"],
}


def publish(queue: str, prefix: str, count: int) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = connection.channel()
    props = pika.BasicProperties(delivery_mode=2)
    for i in range(count):
        props.message_id = f"{prefix}-{i}"
        channel.basic_publish("", queue, b'{"amount": 1}', props)
    deadline = time.monotonic() + 120
    while channel.queue_declare(queue, passive=True).method.message_count < count:
        if time.monotonic() > deadline:
            raise SystemExit("BENCH FAILED: the published messages never all reached the queue")
        time.sleep(0.05)
    connection.close()


TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid`` and its live descendants, from /proc."""
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
            for task in Path(f"/proc/{current}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def drain(
    name: str,
    env: dict[str, str],
    engine,
    schema: str,
    count: int,
) -> tuple[float, float]:
    """Run ``name`` until it applied ``count`` messages: messages a second while consuming,
    and its processes' CPU microseconds a message over the same span (the load of other
    processes on the machine distorts it least)."""
    process = subprocess.Popen(COMMANDS[name], cwd=HERE, env=env, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 600
    first: tuple[int, float] | None = None
    try:
        while (done := scalar(engine, f"SELECT count(*) FROM {schema}.ledger")) < count:
            if first is None and done > 0:
                first = (done, cpu_seconds(process.pid))
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"BENCH FAILED: {name} stopped or stalled: "
                                 f"{process.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]  # fmt: skip
            time.sleep(0.05)
        cpu = cpu_seconds(process.pid)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(120)
    if code != 0:
        raise SystemExit(f"BENCH FAILED: {name} exited {code} on SIGTERM")
    sql = (f"SELECT EXTRACT(EPOCH FROM max(processed_at) - min(processed_at)), count(*), "
           f"(SELECT count(DISTINCT message_id) FROM {schema}.ledger) "
           f"FROM {schema}.processed_events")  # fmt: skip
    with engine.connect() as conn:
        seconds, decided, distinct = conn.execute(text(sql)).one()
    if not (decided == distinct == count):
        raise SystemExit(
            f"BENCH FAILED: {name}: {decided} decided, {distinct} applied, not {count}"
        )
    # processed_at is each batch's transaction start: the first to the last batch's start
    # spans count - batch messages.
    assert first is not None
    return (count - 100) / float(seconds), (cpu - first[1]) / (count - first[0]) * 1e6


def scalar(engine, sql: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(sql)).scalar() or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    add_round_arguments(parser)
    args = parser.parse_args()
    check_rounds(parser, args)
    count = 2_000 if args.quick else args.messages
    conditions = Conditions()
    engine = create_engine(PG_URL)
    conditions.postgres(engine)
    conditions.add("RabbitMQ", f"{AMQP_URL.split('@')[-1]}, a durable classic queue, persistent")
    conditions.add("workload", f"{count:,} messages a round, batch_size 100, prefetch 200, "
                               "one INSERT a message through the Session")  # fmt: skip
    conditions.print()
    schema = f"bench_run_{uuid.uuid4().hex[:8]}"
    queue = f"bench-run-{uuid.uuid4().hex[:8]}"
    install(engine, Tables.define(f"{schema}.processed_events", f"{schema}.outbox"))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {schema}.ledger (message_id TEXT, body TEXT)"))
    with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
        connection.channel().queue_declare(queue, durable=True)
    env = {**os.environ, "BENCH_SCHEMA": schema, "BENCH_QUEUE": queue,
           "CONSUMERDEDUP_DATABASE_URL": PG_URL, "CONSUMERDEDUP_RABBITMQ_URL": AMQP_URL,
           "PYTHONPATH": str(HERE)}  # fmt: skip
    series = {name: Series(name) for name in COMMANDS}
    cpu = {name: Series(name, "us/msg", higher_is_better=False) for name in COMMANDS}
    try:
        names = list(COMMANDS)
        for round_ in range(args.rounds):
            # Each round starts with another configuration: drift falls on all alike.
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                with engine.begin() as conn:
                    conn.execute(text(f"TRUNCATE {schema}.ledger, {schema}.processed_events"))
                publish(queue, f"r{round_}-{uuid.uuid4().hex[:6]}", count)
                rate, cpu_used = drain(name, env, engine, schema, count)
                series[name].add(rate)
                cpu[name].add(cpu_used)
                print(f"  round {round_ + 1} {name}: {rate:,.0f} msg/s, "
                      f"{cpu_used:.0f} us CPU/msg", flush=True)  # fmt: skip
    finally:
        with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
            connection.channel().queue_delete(queue)
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
    print()
    by_hand = series[BY_HAND]
    print_table("Consuming rate", list(series.values()), by_hand, "vs hand")
    print_pairs("Ratios (by hand / run: > 1.00x means run is slower)",
                [(name, by_hand, series[name]) for name in (RUN, RUN_PROBES)])  # fmt: skip
    print_table("CPU of the consuming processes a message", list(cpu.values()), cpu[BY_HAND],
                "vs hand")  # fmt: skip
    for name in (RUN, RUN_PROBES):
        extra_cpu = cpu[name].median - cpu[BY_HAND].median
        share = cpu[name].median / cpu[BY_HAND].median - 1
        verdict = "within" if share <= 0.05 else "OUTSIDE"
        print(f"  {name}: {extra_cpu:+.1f} us CPU a message ({share:+.1%}; "
              f"{verdict} the 5% target)")  # fmt: skip
    print("Wall clock (the load of the machine distorts it most):")
    for name in (RUN, RUN_PROBES):
        extra = (1 / series[name].median - 1 / by_hand.median) * 1e6
        slower = by_hand.median / series[name].median - 1
        verdict = "within" if slower <= 0.05 else "OUTSIDE"
        print(f"  {name}: {extra:+.1f} us a message ({slower:+.1%}; {verdict} the 5% target)")
    hook_cost()
    conditions.print_after()


def hook_cost(batches: int = 2_000, size: int = 100) -> None:
    """The worker's only code on the message path: its metrics hook, once a batch (with
    --health-port). Timed here in process, alone: what it adds a message, without the noise
    of the runs above."""
    import tempfile

    from consumerdedup import Message, Outcome
    from consumerdedup.outcome import Result

    with tempfile.TemporaryDirectory() as folder:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = folder  # before prometheus_client's import
        from consumerdedup.app import metrics
        from consumerdedup.telemetry import hooks

        metrics.install()
        messages = [Message(id=f"m{i}", body=b"{}") for i in range(size)]
        results = [Result(m, Outcome.PROCESSED, None, 1) for m in messages]
        process = hooks.process
        assert process is not None
        started = time.perf_counter()
        for _ in range(batches):
            process.start("ledger", messages).finish(results)
        each = (time.perf_counter() - started) / batches
    print(f"The metrics hook alone: {each * 1e6:.0f} us a batch of {size} = "
          f"{each * 1e6 / size:.2f} us a message (in process, {batches:,} batches)")  # fmt: skip


if __name__ == "__main__":
    main()
