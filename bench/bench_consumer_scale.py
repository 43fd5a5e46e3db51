"""Scaling out the consumers: 1, 2 and 4 runner processes on one PostgreSQL, per broker.

Run: ``.venv/bin/python bench/bench_consumer_scale.py`` (``--rounds N``, at least 3;
``--quick``: one small round; ``--brokers kafka,rabbitmq``). Each consumer is its own
process (spawn start method: no shared GIL, nothing inherited) with its own engine, a
blocking ``Deduplicator`` and the library's runner:

- Kafka: ``KafkaConsumerRunner`` in one consumer group on a fresh ``--partitions``-partition
  topic (8) of Tansu (memory storage, started here as ``bench/tansu.py`` does), records
  spread round-robin over the partitions;
- RabbitMQ: ``RabbitConsumerRunner``, competing consumers on one fresh durable queue of
  persistent messages, ``prefetch`` twice the batch.

Two handlers, each writing one business row per message in the dedup transaction: a
per-message handler (``@dedup.handler``, one INSERT through the Session per message) at
``batch_size`` 100, and a bulk handler (``@dedup.bulk_handler``, one ``executemany`` per
batch) at ``batch_size`` 500. Per configuration the topic or queue gets M fresh messages
(untimed); the N processes start, build their engine, handler and runner, and wait at a
barrier; released, each connects (PostgreSQL, the broker; Kafka: joins the group, so the
joins and rebalances are inside the clock) and runs ``run()`` until the processes' PROCESSED
counts add up to M, then ``stop()`` (its batch in flight finishes, commits and is acked or
its offset committed). Not ``run(until_idle=True)`` by default: on Kafka with several
members a member that still waits in a rebalance Tansu does not finish can hold the run
for minutes (seen 2 times in 22 attempts of ``--until-idle`` with 4 processes).
Two rates per run: from the barrier to the last database commit of any process (its offset
commit or ack follows at once), and after the join: from the moment every process has
committed a batch (all have joined; Tansu's join takes about the session timeout, 1 s) to
the last commit, over the messages committed in that window. Configurations run
round-robin, ``--rounds`` times; a figure is the median of the rounds (``bench/measure.py``).

Checks (a miss exits with status 1): the business table holds M rows, M distinct; the
processed_events table M rows; the PROCESSED counts of the processes add up to M; RabbitMQ:
the queue is empty (nothing ready, nothing unacked); Kafka: the group's committed offset of
every partition is its end (lag 0).

Evidence measured in the same run, in the window after the join (to the last commit):
- client CPU: the consumer processes' user + system time (``/proc/<pid>/stat``, threads
  included), split between them as their own ``resource.getrusage`` from the barrier to
  their last commit;
- PostgreSQL CPU: the consumers' backends (``/proc/<pid>/stat`` of the pids
  ``pg_stat_activity`` shows for their ``application_name``), and apart the server's own
  processes (postmaster, WAL writer, checkpointer, ...: shared with anyone else on the server);
- the broker's CPU: Tansu's process, or RabbitMQ's ``beam.smp`` (shared with anyone else on it);
- the machine: busy CPU from ``/proc/stat`` in cores (2 here), this bench's own process (the
  sampler) and what is left after all of these: other work on the machine;
- waits: ``pg_stat_activity`` sampled every 20 ms: what the consumers' active backends wait
  on (CPU when nothing; Client:ClientRead: PostgreSQL waits for the client; IO:WALSync /
  IO:WALWrite / LWLock:WALWrite: the WAL flush; Lock:*: row or transaction locks);
- transactions (the batches the processes committed) and, from ``pg_stat_wal``, the WAL
  flushes (``wal_sync``) and bytes of the whole server over the run (others' included).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiokafka
import pika
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome, Result, Tables, install
from consumerdedup.adapters.kafka import KafkaConfig, KafkaConsumerRunner
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner

sys.path.insert(0, os.path.dirname(__file__))
from measure import (
    Conditions,
    Series,
    add_round_arguments,
    check_rounds,
    fmt,
    load_average,
    print_table,
)
from tansu import start_tansu

PG_URL = os.environ.get(
    "CONSUMERDEDUP_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
AMQP_URL = os.environ.get("CONSUMERDEDUP_BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")
PROCESSES = (1, 2, 4)
APP = "consumerdedup-bench-consumer"
TICK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
GROUP_OPTIONS = {"session_timeout_ms": 1000, "heartbeat_interval_ms": 250}
WAL_WAITS = ("IO:WALSync", "IO:WALWrite", "LWLock:WALWrite", "IO:WALInitSync")


class Failure(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"BENCH FAILED: {message}")


@dataclass(frozen=True)
class Handler:
    name: str
    bulk: bool
    batch: int


HANDLERS = (Handler("per-message", False, 100), Handler("bulk", True, 500))


# --------------------------------------------------------------------------- one consumer


def consumer_process(
    spec: dict[str, Any], start: Any, done: Any, counter: Any, first: Any, out: Any
) -> None:
    """One runner process: build everything, wait at ``start``, consume until idle, report,
    wait at ``done`` (the parent reads this process's backend CPU) and close."""
    engine = create_engine(
        PG_URL, pool_size=5, connect_args={"application_name": f"{APP}-{spec['k']}"}
    )
    tables = Tables.define(f"{spec['schema']}.processed_events", f"{spec['schema']}.outbox")
    dedup = Deduplicator(engine, consumer="bench-consumer", tables=tables)
    insert = text(f"INSERT INTO {spec['schema']}.ledger (message_id, n) VALUES (:m, :n)")
    if spec["bulk"]:

        @dedup.bulk_handler
        def apply_bulk(messages: list[Message], session: Session) -> None:
            session.execute(insert, [{"m": m.id, "n": len(m.body)} for m in messages])

        handler: Any = apply_bulk
    else:

        @dedup.handler
        def apply(message: Message, session: Session) -> None:
            session.execute(insert, {"m": message.id, "n": len(message.body)})

        handler = apply
    tally = {"processed": 0, "duplicate": 0, "other": 0, "batches": 0, "first": 0.0, "last": 0.0}
    cpu = {"start": 0.0, "last": 0.0}
    timeline: list[tuple[float, int]] = []  # (monotonic time of a commit, PROCESSED in it)

    def through(results: Sequence[Result]) -> None:
        processed = sum(r.outcome is Outcome.PROCESSED for r in results)
        duplicate = sum(r.outcome is Outcome.DUPLICATE for r in results)
        tally["processed"] += processed
        tally["duplicate"] += duplicate
        tally["other"] += len(results) - processed - duplicate
        tally["batches"] += 1
        now = time.monotonic()
        tally["first"] = tally["first"] or now
        tally["last"] = now
        cpu["last"] = own_cpu()
        timeline.append((now, processed))
        first[spec["k"]] = 1
        if processed:
            with counter.get_lock():
                counter.value += processed

    batch = spec["batch"]
    runner: Any
    if spec["broker"] == "kafka":
        config = KafkaConfig(
            batch_size=batch,
            poll_timeout=timedelta(milliseconds=100),
            idempotent_producer=False,  # Tansu has no InitProducerId
            consumer_options=GROUP_OPTIONS,
        )
        runner = KafkaConsumerRunner(
            handler,
            spec["topic"],
            bootstrap_servers=spec["bootstrap"],
            group_id=spec["group"],
            config=config,
            before_ack=through,
        )
    else:
        rabbit = RabbitConfig(prefetch=2 * batch, batch_size=batch)
        runner = RabbitConsumerRunner(
            handler, spec["queue"], url=AMQP_URL, config=rabbit, before_ack=through
        )
    finished = threading.Event()

    def stop_when_all_processed() -> None:
        """Every process's PROCESSED count adds up to the target: stop (the batch in flight
        finishes, commits its offset or acks, and run() returns)."""
        while not finished.wait(0.01):
            if counter.value >= spec["count"]:
                runner.stop()
                return

    until_idle = spec["until_idle"]
    start.wait()
    cpu["start"] = cpu["last"] = own_cpu()
    if not until_idle:
        threading.Thread(target=stop_when_all_processed, daemon=True).start()
    error = ""
    try:
        if spec["broker"] == "kafka":
            asyncio.run(runner.run(until_idle=until_idle))
        else:
            runner.run(until_idle=until_idle)
    except BaseException:  # reported, so the parent fails the run instead of hanging
        error = traceback.format_exc()
    report = {**tally, "k": spec["k"], "cpu": cpu["last"] - cpu["start"], "error": error}
    finished.set()
    out.put({**report, "timeline": timeline})
    done.wait()
    engine.dispose()


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --------------------------------------------------------------------------- /proc


def proc_cpu(pid: int) -> float:
    """User + system seconds of a process (all its threads), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def pids_named(name: str, parent: int | None = None) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm", encoding="utf-8") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm == name and (parent is None or proc_parent(int(entry)) == parent):
            found.append(int(entry))
    return found


def machine_busy() -> tuple[float, float]:
    """(busy, of which niced) CPU seconds over all CPUs since boot: niced work (other
    people's tests under ``nice``) yields the cores to work at normal priority."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / TICK, fields[1] / TICK


# --------------------------------------------------------------------------- the evidence


@dataclass
class Snapshot:
    at: float
    machine: float  # busy CPU seconds of the whole machine since boot
    niced: float  # of which niced
    clients: float  # the consumer processes' CPU seconds (/proc)
    broker: float
    server: float  # PostgreSQL's own processes
    sampler: float  # this bench's own process (the sampler thread)
    backends: dict[int, float] = field(default_factory=dict)  # the consumers' backends


@dataclass
class Evidence:
    """What one run measured besides its rate: CPU over the steady window (from the moment
    every process has committed a batch to the last commit), in seconds; wait samples of the
    same window; the run's totals."""

    window: float
    rate: float  # msg/s in the steady window
    join: float  # barrier -> every process has committed a batch
    split: list[int]
    duplicates: int
    batches: int
    clients: list[float]  # per process
    backends: float
    server: float
    broker: float
    sampler: float
    machine: float
    niced: float
    wal_syncs: int
    wal_bytes: int
    waits: Counter[str] = field(default_factory=Counter)

    def cores(self, seconds: float) -> float:
        return seconds / self.window if self.window else 0.0

    @property
    def messages(self) -> float:
        """Messages committed in the CPU window (its rate times its length)."""
        return max(self.rate * self.window, 1.0)

    @property
    def other(self) -> float:
        ours = sum(self.clients) + self.backends + self.server + self.broker + self.sampler
        return max(0.0, self.machine - ours)

    def share(self, *events: str) -> float:
        seen = sum(self.waits.values())
        return sum(self.waits[e] for e in events) / seen if seen else 0.0

    def lock_share(self) -> float:
        seen = sum(self.waits.values())
        locks = sum(v for k, v in self.waits.items() if k.startswith("Lock:"))
        return locks / seen if seen else 0.0

    def line(self) -> str:
        seen = sum(self.waits.values()) or 1
        top = ", ".join(f"{k} {100 * v / seen:.0f}%" for k, v in self.waits.most_common(4))
        each = "+".join(f"{self.cores(c):.2f}" for c in self.clients)
        return (
            f"all committing after {self.join:.2f} s, then {self.rate:,.0f} msg/s for "
            f"{self.window:.2f} s; split {'/'.join(map(str, self.split))}, {self.batches} "
            f"transactions, {self.duplicates} duplicates; cores: clients "
            f"{self.cores(sum(self.clients)):.2f} ({each}), PostgreSQL backends "
            f"{self.cores(self.backends):.2f} + server {self.cores(self.server):.2f}, broker "
            f"{self.cores(self.broker):.2f}, sampler {self.cores(self.sampler):.2f}, machine "
            f"{self.cores(self.machine):.2f} of {CORES} (other {self.cores(self.other):.2f}, "
            f"niced {self.cores(self.niced):.2f}); "
            f"WAL flushes {self.wal_syncs} "
            f"({self.wal_bytes / 1e6:.0f} MB, whole run, whole server); waits: {top}"
        )


def verdict(ev: dict[str, float]) -> str:
    """The bottleneck the medians point at, with the figures that say so. Niced work of
    others is shown apart: it yields the cores to ours only in part (CFS weights are per
    thread, and several niced processes add up), so full cores are a CPU limit either way."""
    busy, niced = ev["machine"], ev["niced"]
    base = (
        f"machine {busy:.2f}/{CORES} cores busy (consumers {ev['clients']:.2f}, PostgreSQL "
        f"{ev['pg']:.2f}, broker {ev['broker']:.2f}, other {ev['other']:.2f} of which niced "
        f"{niced:.2f}); the consumers' backends: on CPU {ev['w_cpu']:.0%}, waiting for the "
        f"client {ev['w_client']:.0%}, WAL {ev['w_wal']:.0%}, locks {ev['w_lock']:.0%}"
    )
    if busy >= 0.85 * CORES:
        parts = {"the consumer processes": ev["clients"], "PostgreSQL": ev["pg"]}
        parts["the broker"] = ev["broker"]
        parts["other work on the machine"] = ev["other"]
        biggest = max(parts, key=lambda k: parts[k])
        waiting = "; PostgreSQL mostly waits for the consumers" if ev["w_client"] >= 0.4 else ""
        return f"CPU-bound: both cores busy, the largest share {biggest}{waiting}: {base}"
    if ev["w_lock"] >= 0.2:
        return f"locks: {base}"
    if ev["w_wal"] >= 0.3:
        return f"the WAL flush: {base}"
    if ev["per_client"] >= 0.8:
        return f"one consumer process's CPU (a core, its GIL): {base}"
    if ev["w_client"] >= 0.4:
        return f"the consumer processes (PostgreSQL waits on them, CPU to spare): {base}"
    if ev["broker"] >= 0.5:
        return f"the broker: {base}"
    return f"no single limit (round trips between the parts): {base}"


class Sampler:
    """From the barrier: samples the consumers' backends every 20 ms, snapshots the CPU
    figures when every process has committed a batch (the join) and as soon as the
    processes' PROCESSED count reaches the target (their last commit)."""

    def __init__(
        self,
        engine: Engine,
        counter: Any,
        first: Any,
        target: int,
        clients: list[int],
        broker: list[int],
    ) -> None:
        self.engine, self.counter, self.first, self.target = engine, counter, first, target
        self.client_pids, self.broker_pids = clients, broker
        self.waits: Counter[str] = Counter()
        self.backend_pids: set[int] = set()
        self.stop = threading.Event()
        self.join: Snapshot | None = None
        self.end: Snapshot | None = None
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT pid FROM pg_stat_activity WHERE backend_type <> 'client backend'")
            ).all()
        self.server = [row[0] for row in rows]
        self.server += sorted({proc_parent(pid) for pid in self.server} - {0})  # postmaster
        self.start = self.snapshot()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def snapshot(self) -> Snapshot:
        return Snapshot(
            time.monotonic(),
            *machine_busy(),
            sum(proc_cpu(p) for p in self.client_pids),
            sum(proc_cpu(p) for p in self.broker_pids),
            sum(proc_cpu(p) for p in self.server),
            proc_cpu(os.getpid()),
            {p: proc_cpu(p) for p in self.backend_pids},
        )

    def run(self) -> None:
        query = text(
            "SELECT pid, state, coalesce(wait_event_type || ':' || wait_event, 'CPU') "
            f"FROM pg_stat_activity WHERE application_name LIKE '{APP}-%'"
        )
        with self.engine.connect() as conn:
            conn.execute(text("SET application_name = 'bench-sampler'"))
            conn.commit()
            while not self.stop.is_set():
                if self.counter.value >= self.target:
                    self.end = self.snapshot()
                    return
                if self.join is None and all(self.first):
                    self.join = self.snapshot()
                for pid, state, wait in conn.execute(query):
                    self.backend_pids.add(pid)
                    if state == "active" and self.join is not None:
                        self.waits[wait] += 1
                conn.commit()
                time.sleep(0.02)


def wal_stats(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        row = conn.execute(text("SELECT wal_sync, wal_bytes FROM pg_stat_wal")).one()
    return int(row[0]), int(row[1])


# --------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, args: argparse.Namespace, stack: contextlib.ExitStack) -> None:
        self.args = args
        self.tag = uuid.uuid4().hex[:8]
        self.schema = f"bench_cscale_{self.tag}"
        self.engine = create_engine(PG_URL)
        self.tables = Tables.define(f"{self.schema}.processed_events", f"{self.schema}.outbox")
        self.ctx = mp.get_context("spawn")
        self.bootstrap = ""
        self.tansu_version = ""
        self.tansu_pids: list[int] = []
        self.topics: list[str] = []
        self.amqp: Any = None
        self.channel: Any = None
        self.rabbit_version = "?"
        if "kafka" in args.brokers:
            self.bootstrap, self.tansu_version = start_tansu(stack)
            self.tansu_pids = pids_named("tansu", parent=os.getpid())
        if "rabbitmq" in args.brokers:
            self.amqp = pika.BlockingConnection(pika.URLParameters(AMQP_URL))
            self.channel = self.amqp.channel()
            self.rabbit_version = self.amqp._impl.server_properties.get("version", b"?")
            if isinstance(self.rabbit_version, bytes):
                self.rabbit_version = self.rabbit_version.decode()
        self.beam_pids = pids_named("beam.smp") if self.amqp else []

    def setup(self) -> None:
        install(self.engine, self.tables)
        with self.engine.begin() as conn:
            conn.execute(text(f"CREATE TABLE {self.schema}.ledger (message_id text, n int)"))

    def teardown(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{self.schema}" CASCADE'))
        self.engine.dispose()
        if self.amqp is not None:
            self.amqp.close()
        if self.topics:
            asyncio.run(self.delete_topics())

    async def delete_topics(self) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.delete_topics(self.topics)
        except Exception:  # a broker that cannot delete topics keeps them: names are unique
            pass
        finally:
            await admin.close()

    def body(self, i: int) -> bytes:
        pad = b"x" * max(0, int(self.args.body_size) - 40)
        return b'{"amount": %d, "pad": "' % (i % 1000) + pad + b'"}'

    # ---- filling, untimed

    async def fill_topic(self, topic: str, count: int) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, self.args.partitions, 1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, linger_ms=5)
        await producer.start()
        try:
            futures = []
            for i in range(count):
                headers = [("event_id", f"{topic}-{i}".encode())]
                partition = i % self.args.partitions
                futures.append(
                    await producer.send(topic, self.body(i), partition=partition, headers=headers)
                )
            await asyncio.gather(*futures)
        finally:
            await producer.stop()

    def fill_queue(self, queue: str, count: int) -> None:
        self.channel.queue_declare(queue + ".dlq", durable=True)
        self.channel.queue_declare(queue, durable=True)
        for i in range(count):
            props = pika.BasicProperties(message_id=f"{queue}-{i}", delivery_mode=2)
            self.channel.basic_publish("", queue, self.body(i), props)
        while self.channel.queue_declare(queue, passive=True).method.message_count < count:
            self.amqp.sleep(0.05)

    # ---- checks

    async def kafka_lag(self, topic: str, group: str, count: int) -> int:
        """Records behind the group's committed offsets, over all partitions."""
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=group, enable_auto_commit=False
        )
        await consumer.start()
        try:
            parts = self.args.partitions
            lag = 0
            for p in range(parts):
                end = len(range(p, count, parts))  # a fresh topic: offsets 0..end-1
                lag += end - ((await consumer.committed(TopicPartition(topic, p))) or 0)
            return lag
        finally:
            await consumer.stop()

    def check(
        self, broker: str, where: str, group: str, count: int, got: list[dict[str, Any]]
    ) -> None:
        label = f"{broker} {len(got)} process(es)"
        errors = [r["error"] for r in got if r["error"]]
        if errors:
            raise Failure(f"{label}: a runner raised {errors[0]}")
        processed = sum(r["processed"] for r in got)
        if processed != count:
            raise Failure(f"{label}: {processed} PROCESSED, expected {count}")
        with self.engine.connect() as conn:
            rows, distinct = conn.execute(
                text(f"SELECT count(*), count(DISTINCT message_id) FROM {self.schema}.ledger")
            ).one()
            recorded = conn.execute(
                text(f"SELECT count(*) FROM {self.tables.processed_events.fullname}")
            ).scalar()
        if (rows, distinct, recorded) != (count, count, count):
            raise Failure(
                f"{label}: {rows} business rows ({distinct} distinct), {recorded} in "
                f"processed_events, expected {count} each"
            )
        if broker == "rabbitmq":
            left = self.channel.queue_declare(where, passive=True).method.message_count
            if left:
                raise Failure(f"{label}: {left} messages left in {where}")
            self.channel.queue_delete(where)
            self.channel.queue_delete(where + ".dlq")
        else:
            lag = asyncio.run(self.kafka_lag(where, group, count))
            if lag:
                raise Failure(f"{label}: group {group} lags {lag} records on {where}")

    # ---- one run

    def run_one(self, broker: str, handler: Handler, n: int) -> tuple[float, Evidence]:
        """One configuration once; (msg/s from the barrier, the evidence)."""
        count = self.args.messages_bulk if handler.bulk else self.args.messages
        with self.engine.begin() as conn:
            conn.execute(
                text(f"TRUNCATE {self.schema}.ledger, {self.tables.processed_events.fullname}")
            )
        where = f"bench-cscale-{uuid.uuid4().hex[:10]}"
        group = f"group-{where}"
        if broker == "kafka":
            self.topics += [where, where + ".dlq"]
            asyncio.run(self.fill_topic(where, count))
        else:
            self.fill_queue(where, count)
        with self.engine.begin() as conn:
            conn.execute(text(f"ANALYZE {self.schema}.ledger"))
        start, done = self.ctx.Barrier(n + 1), self.ctx.Barrier(n + 1)
        counter, first, out = self.ctx.Value("q", 0), self.ctx.Array("b", n), self.ctx.Queue()
        spec = {
            "schema": self.schema,
            "broker": broker,
            "bulk": handler.bulk,
            "batch": handler.batch,
            "topic": where,
            "queue": where,
            "group": group,
            "bootstrap": self.bootstrap,
            "count": count,
            "until_idle": self.args.until_idle,
        }
        procs = [
            self.ctx.Process(
                target=consumer_process,
                args=({**spec, "k": k}, start, done, counter, first, out),
            )
            for k in range(n)
        ]
        for proc in procs:
            proc.start()
        broker_pids = self.tansu_pids if broker == "kafka" else self.beam_pids
        wal_before = wal_stats(self.engine)
        clients = [proc.pid for proc in procs if proc.pid]
        start.wait(timeout=120)
        sampler = Sampler(self.engine, counter, first, count, clients, broker_pids)
        sampler.thread.start()
        try:
            got = [out.get(timeout=600) for _ in procs]
        finally:
            sampler.stop.set()
            sampler.thread.join()
            done.wait(timeout=60)
            for proc in procs:
                proc.join(60)
        self.check(broker, where, group, count, got)
        wal_after = wal_stats(self.engine)
        began = sampler.start.at
        end = sampler.end or sampler.snapshot()
        join = sampler.join or sampler.start
        # The steady window's rate from the processes' own commit times.
        t_join = max(r["first"] for r in got if r["first"])
        t_end = max(r["last"] for r in got)
        after = sum(p for r in got for t, p in r["timeline"] if t > t_join)
        clients_cpu = [r["cpu"] for r in sorted(got, key=lambda r: r["k"])]
        share = [c / (sum(clients_cpu) or 1) for c in clients_cpu]
        evidence = Evidence(
            window=end.at - join.at,
            rate=after / (t_end - t_join) if t_end > t_join else float("nan"),
            join=t_join - began,
            split=[r["processed"] for r in sorted(got, key=lambda r: r["k"])],
            duplicates=sum(r["duplicate"] for r in got),
            batches=sum(r["batches"] for r in got),
            clients=[(end.clients - join.clients) * s for s in share],
            backends=sum(c - join.backends.get(p, 0.0) for p, c in end.backends.items()),
            server=end.server - join.server,
            broker=end.broker - join.broker,
            sampler=end.sampler - join.sampler,
            machine=end.machine - join.machine,
            niced=end.niced - join.niced,
            wal_syncs=wal_after[0] - wal_before[0],
            wal_bytes=wal_after[1] - wal_before[1],
            waits=sampler.waits,
        )
        return count / (t_end - began), evidence


def summary(evidence: list[Evidence]) -> dict[str, float]:
    """Medians over the rounds of the figures a verdict reads, in cores and shares."""

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "machine": med([e.cores(e.machine) for e in evidence]),
        "niced": med([e.cores(min(e.niced, e.other)) for e in evidence]),
        "ours": med([e.cores(e.machine - e.other - e.sampler) for e in evidence]),
        "us_clients": med([1e6 * sum(e.clients) / e.messages for e in evidence]),
        "us_pg": med([1e6 * (e.backends + e.server) / e.messages for e in evidence]),
        "us_broker": med([1e6 * e.broker / e.messages for e in evidence]),
        "clients": med([e.cores(sum(e.clients)) for e in evidence]),
        "per_client": med([e.cores(max(e.clients)) for e in evidence]),
        "pg": med([e.cores(e.backends + e.server) for e in evidence]),
        "broker": med([e.cores(e.broker) for e in evidence]),
        "other": med([e.cores(e.other) for e in evidence]),
        "w_cpu": med([e.share("CPU") for e in evidence]),
        "w_client": med([e.share("Client:ClientRead") for e in evidence]),
        "w_wal": med([e.share(*WAL_WAITS) for e in evidence]),
        "w_lock": med([e.lock_share() for e in evidence]),
        "join": med([e.join for e in evidence]),
        "window": med([e.window for e in evidence]),
        "tx_per_s": med([e.batches / (e.join + e.window) for e in evidence]),
        "wal_per_s": med([e.wal_syncs / (e.join + e.window) for e in evidence]),
    }


def run(args: argparse.Namespace, bench: Bench) -> None:
    configs = [(b, h) for b in args.brokers for h in HANDLERS]
    keys = [(b, h.name, n) for b, h in configs for n in PROCESSES]

    def name(key: tuple[str, str, int], what: str) -> str:
        broker, handler, n = key
        return f"{broker:<8} {handler:<11} {n} process{'es' if n > 1 else '  '} {what}"

    total = {key: Series(name(key, "from the barrier")) for key in keys}
    steady = {key: Series(name(key, "after the join")) for key in keys}
    evidence: dict[tuple[str, str, int], list[Evidence]] = {key: [] for key in keys}
    for round_no in range(1, args.rounds + 1):
        print(f"round {round_no}/{args.rounds} (load {load_average()})", flush=True)
        for broker, handler in configs:
            for n in PROCESSES:
                rate, ev = bench.run_one(broker, handler, n)
                key = (broker, handler.name, n)
                total[key].add(rate)
                steady[key].add(ev.rate)
                evidence[key].append(ev)
                print(f"  {broker} {handler.name} {n}p: {rate:,.0f} msg/s; {ev.line()}", flush=True)
    print()
    for broker, handler in configs:
        rows = [(broker, handler.name, n) for n in PROCESSES]
        count = args.messages_bulk if handler.bulk else args.messages
        print_table(
            f"{broker}: {handler.name} handler, batch {handler.batch}, {count} messages, "
            "N consumer processes on one PostgreSQL",
            [total[k] for k in rows] + [steady[k] for k in rows],
        )
        base_total, base_steady = total[rows[0]], steady[rows[0]]
        print("  speed-up (ratio of medians, same run): from the barrier / after the join")
        for key in rows:
            print(
                f"    {key[2]} process{'es' if key[2] > 1 else '  '}: "
                f"{total[key].ratio(base_total):.2f}x / {steady[key].ratio(base_steady):.2f}x"
            )
        print("  bottleneck at each step (medians of the rounds' steady-window evidence):")
        for key in rows:
            s = summary(evidence[key])
            rate = steady[key].median
            print(
                f"    {key[2]} process{'es' if key[2] > 1 else '  '}: {fmt(rate)} msg/s after "
                f"the join ({fmt(rate / max(s['ours'], 0.01))} msg/s per core of ours: "
                f"consumers + PostgreSQL + broker), joined "
                f"after {s['join']:.2f} s; {fmt(s['tx_per_s'])} transactions/s, "
                f"{fmt(s['wal_per_s'])} WAL flushes/s (server); the busiest consumer "
                f"{s['per_client']:.2f} cores"
            )
            per = s["us_clients"] + s["us_pg"] + s["us_broker"]
            if per <= 0 or s["window"] <= 0:
                # The run ended between two of the sampler's snapshots: no CPU was seen.
                print(
                    "      CPU per message: not measured (the steady window was shorter than "
                    "the sampler's interval): run with more --messages/--messages-bulk"
                )
                continue
            print(
                f"      CPU per message: consumers {s['us_clients']:.0f} us + PostgreSQL "
                f"{s['us_pg']:.0f} us + broker {s['us_broker']:.0f} us = {per:.0f} us: "
                f"{CORES} idle cores would carry at most {fmt(CORES * 1e6 / per)} msg/s"
            )
            print(f"      {verdict(s)}")
        print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_round_arguments(parser)
    parser.add_argument(
        "--brokers", default="kafka,rabbitmq", help="comma-separated: kafka, rabbitmq"
    )
    parser.add_argument("--partitions", type=int, default=8, help="Kafka topic partitions (8)")
    parser.add_argument("--messages", type=int, help="per run, per-message handler (20000)")
    parser.add_argument("--messages-bulk", type=int, help="per run, bulk handler (50000)")
    parser.add_argument("--body-size", type=int, default=256)
    parser.add_argument(
        "--until-idle",
        action="store_true",
        help="end each process with run(until_idle=True) instead of stop() once all are "
        "processed (on Kafka with 4 processes a stalled rebalance can hold it: see the docstring)",
    )
    args = parser.parse_args()
    check_rounds(parser, args)
    args.brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    if not args.brokers or set(args.brokers) - {"kafka", "rabbitmq"}:
        parser.error("--brokers takes kafka, rabbitmq or both")
    args.messages = args.messages or (2000 if args.quick else 20000)
    args.messages_bulk = args.messages_bulk or (5000 if args.quick else 50000)
    conditions = Conditions()
    with contextlib.ExitStack() as stack:
        bench = Bench(args, stack)
        conditions.postgres(bench.engine)
        if bench.bootstrap:
            conditions.add(
                "Kafka",
                f"{bench.tansu_version} on this machine at {bench.bootstrap}, MEMORY storage "
                f"(acknowledges without a disk write); {args.partitions} partitions; "
                f"aiokafka {aiokafka.__version__}; group {GROUP_OPTIONS}",
            )
        if bench.amqp is not None:
            conditions.add(
                "RabbitMQ",
                f"{bench.rabbit_version} on this machine: one durable classic queue, persistent "
                f"messages, competing consumers, prefetch 2 x batch; pika {pika.__version__}",
            )
        conditions.add(
            "consumers",
            "N processes (spawn), each its own engine (pool 5), a blocking Deduplicator and "
            "the library's runner; Kafka partitions_in_flight 4; "
            + (
                "each returns by run(until_idle=True)"
                if args.until_idle
                else "each stopped (stop()) once the processes' PROCESSED counts add up to M"
            ),
        )
        conditions.add(
            "messages",
            f"{args.messages} per run (per-message handler, batch 100), {args.messages_bulk} "
            f"(bulk handler, batch 500); {args.body_size}-byte JSON bodies; one business row "
            "each",
        )
        conditions.add(
            "clock",
            "from the barrier (then the processes connect; Kafka: join the group) to the last "
            "database commit of any process",
        )
        conditions.add("rounds", f"{args.rounds}, every configuration round-robin")
        conditions.print()
        bench.setup()
        try:
            run(args, bench)
        finally:
            bench.teardown()
    conditions.print_after()


if __name__ == "__main__":
    main()
