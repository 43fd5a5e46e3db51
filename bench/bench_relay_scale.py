"""Scaling out the outbox relay: 1, 2 and 4 relay processes draining one outbox on PostgreSQL.

Run: ``.venv/bin/python bench/bench_relay_scale.py`` (``--rounds N``, at least 3;
``--quick``: one small round; ``--target memory|rabbitmq``). Each relay is its own process
(no shared GIL) with its own engine and publisher: MemoryBroker (the relay's own cost and
the database's) or RabbitPublisher (persistent messages to one durable queue, publisher
confirms, pipelined). Per configuration an emptied outbox gets N events over ``--keys``
keys (untimed, then ANALYZE); the relays start, open their engine and publisher, and
wait at a barrier; the clock starts when they are released and stops when the last one
sees the backlog empty (a relay whose round found every key taken goes again). While they
run, ``pg_stat_activity`` is sampled every 20 ms: what the relays' backends wait on
(CPU when they wait on nothing, Client:ClientRead when PostgreSQL waits for the relay,
IO:WALSync / LWLock:WALWrite for the WAL flush, Lock:advisory or Lock:transactionid for
locks). The relays' own CPU time (user + system, from the processes) is printed beside
the wall time: relays x wall / CPU near the core count means the relays are CPU-bound.

Checks (a miss exits with status 1): every event published once (the relays' counts add
up to N), backlog 0, nothing parked; RabbitMQ: the queue holds N messages.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import pika
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Outbox, OutboxRelay, RelayConfig, Tables, install
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from consumerdedup.testing import MemoryBroker

sys.path.insert(0, os.path.dirname(__file__))
from measure import Conditions, Series, add_round_arguments, check_rounds, print_table

PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
RELAYS = (1, 2, 4)
BATCH = 500


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


def relay_process(
    schema: str, target: str, queue: str, start: Any, results: Any, name: str
) -> None:
    """One relay: drain until a round finds nothing; report (published, CPU seconds)."""
    engine = create_engine(PG_URL)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    publisher: Any = MemoryBroker() if target == "memory" else RabbitPublisher(AMQP_URL)
    config = RelayConfig(batch_size=BATCH, poll_interval=timedelta(seconds=1))
    relay = OutboxRelay(engine, publisher, tables=tables, config=config)
    relay.sender.open()
    with engine.connect() as conn:
        conn.execute(text("SELECT 1"))
    start.wait()
    before = resource.getrusage(resource.RUSAGE_SELF)
    published = 0
    while relay.backlog() > 0:  # not drain(): a round may find every key taken by the others
        published += relay.run_once()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    relay.close()
    engine.dispose()
    results.put((name, published, cpu))


def sample_waits(engine: Any, stop: threading.Event, waits: Counter[str]) -> None:
    """What the relays' backends (application_name relay-*) wait on, every 20 ms."""
    query = text(
        "SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity "
        "WHERE application_name LIKE 'consumerdedup-bench-relay%' AND state = 'active'"
    )
    with engine.connect() as conn:
        conn.execute(text("SET application_name = 'bench-sampler'"))
        conn.commit()
        while not stop.is_set():
            waits.update(row[0] for row in conn.execute(query))
            conn.commit()
            time.sleep(0.02)


def run(args: argparse.Namespace) -> None:
    schema = f"bench_scale_{uuid.uuid4().hex[:8]}"
    engine = create_engine(PG_URL)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    queue = f"bench-scale-{uuid.uuid4().hex[:8]}"
    amqp = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
    channel = amqp.channel()
    channel.queue_declare(queue, durable=True, arguments={"x-queue-type": "classic"})
    destination = queue if args.target == "rabbitmq" else "bench"
    outbox = Outbox(tables)
    series = {
        n: Series(f"{args.target} {n} relay{'s' if n > 1 else ''}", "events/s") for n in RELAYS
    }
    notes: dict[int, list[str]] = {n: [] for n in RELAYS}
    ctx = mp.get_context("spawn")
    os.environ["PGAPPNAME"] = "consumerdedup-bench-relay"
    try:
        for round_no in range(1, args.rounds + 1):
            for n in RELAYS:
                with engine.begin() as conn:
                    conn.execute(text(f"TRUNCATE {tables.outbox.fullname}"))
                channel.queue_purge(queue)
                with Session(engine) as session:
                    for i in range(args.events):
                        outbox.add(session, destination, b"x" * 256, key=f"k{i % args.keys}")
                        if i % 1000 == 999:
                            session.commit()
                    session.commit()
                with engine.begin() as conn:
                    conn.execute(text(f"ANALYZE {tables.outbox.fullname}"))
                start, results = ctx.Barrier(n + 1), ctx.Queue()
                procs = [
                    ctx.Process(
                        target=relay_process,
                        args=(schema, args.target, queue, start, results, f"relay-{k}"),
                    )
                    for k in range(n)
                ]
                for proc in procs:
                    proc.start()
                waits: Counter[str] = Counter()
                stop = threading.Event()
                sampler = threading.Thread(target=sample_waits, args=(engine, stop, waits))
                start.wait()
                began = time.perf_counter()
                sampler.start()
                got = [results.get(timeout=300) for _ in procs]
                wall = time.perf_counter() - began
                stop.set()
                sampler.join()
                for proc in procs:
                    proc.join(30)
                total = sum(published for _, published, _ in got)
                cpu = sum(c for _, _, c in got)
                if total != args.events:
                    raise Failure(f"{n} relays published {total}, expected {args.events}")
                backlog = OutboxRelay(engine, MemoryBroker(), tables=tables).backlog()
                if backlog:
                    raise Failure(f"{n} relays left a backlog of {backlog}")
                if args.target == "rabbitmq":
                    held = channel.queue_declare(queue, passive=True).method.message_count
                    if held != args.events:
                        raise Failure(f"{n} relays: the queue holds {held}, not {args.events}")
                series[n].add(total / wall)
                seen = sum(waits.values()) or 1
                top = ", ".join(f"{k} {100 * v / seen:.0f}%" for k, v in waits.most_common(4))
                split = "/".join(str(p) for _, p, _ in got)
                notes[n].append(
                    f"round {round_no}: {total / wall:,.0f} ev/s, wall {wall:.2f} s, relay CPU "
                    f"{cpu:.2f} s ({cpu / wall:.2f} cores), split {split}; waits: {top}"
                )
                print(f"  {n} relays: {notes[n][-1]}", flush=True)
    finally:
        channel.queue_delete(queue)
        amqp.close()
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        engine.dispose()
    print()
    print_table(
        f"Relays on one outbox ({args.events} events over {args.keys} keys, batch {BATCH}, "
        f"{args.target})",
        list(series.values()),
    )
    base = series[1].median
    print("Relays / one relay, same run")
    for n in RELAYS:
        print(f"  {n} relays: {series[n].median / base:.2f}x one relay")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(parser)
    parser.add_argument("--target", choices=("memory", "rabbitmq"), default="memory")
    parser.add_argument("--keys", type=int, default=200, help="distinct event keys (200)")
    args = parser.parse_args()
    check_rounds(parser, args)
    args.events = 4000 if args.quick else 20000
    conditions = Conditions()
    engine = create_engine(PG_URL)
    conditions.postgres(engine)
    engine.dispose()
    conditions.add("relays", "processes, each its own engine and publisher")
    conditions.print()
    run(args)
    conditions.print_after()


if __name__ == "__main__":
    main()
