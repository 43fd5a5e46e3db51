"""End-to-end chaos (issue 11): every role killed with SIGKILL, and still each effect once.

    3 producers --(Outbox.add)--> outbox --2 OutboxRelays--> RabbitMQ (fanout exchange)
      --> work queue --2 RabbitConsumerRunners (Deduplicator: a row + Outbox.add)--> outbox_kafka
      --1 OutboxRelay--> Kafka topic (4 partitions) --2 KafkaConsumerRunners--> final rows

Each role is a process of its own (tests/support/chaos_roles.py). While the events flow,
every role instance is killed with SIGKILL three times, each time when its hop's
progress crosses a random threshold (often waiting until the role is inside a database
transaction: a relay between publishing and marking), and started again; the RabbitMQ
connections of this run are closed from the broker side once (rabbitmqctl), and the
Kafka roles' broker connections are reset once (``ss -K``, when the host allows it).
Then the pipeline settles, the roles are stopped, and the test checks:

- each hop's effects exactly once, counted per business id in tables WITHOUT unique
  keys (produced, mid_effects, final_effects), and one processed_events record per
  event for each consumer;
- nothing left in the outboxes (published_at set on every row, none parked) or the
  brokers (work queue and its DLQ empty, Kafka group committed to the end, no dead letter);
- per-key order where the README promises it: the relays publish a key's events in
  outbox order (first occurrences, read on a tap queue bound to the same exchange and on
  the Kafka topic; one partition per key), and the Kafka consumers apply a key's events
  in that order. The RabbitMQ hop has two consumers, so no order is promised there.

It runs on PostgreSQL and on MariaDB (the final consumers: one AsyncDeduplicator, on
aiomysql there, and one blocking). The seed is printed; ``CHAOS_SEED=<n>`` replays the
same keys, kill thresholds and restart delays (the timing of the processes is still the
machine's).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from consumerdedup import install
from tests.conftest import Database, database
from tests.support import services
from tests.support.chaos_roles import (
    FINAL_CONSUMER,
    MID_CONSUMER,
    RELAY,
    Chaos,
    create_business_tables,
)
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401
from tests.support.rabbitmq_service import (  # noqa: F401
    Broker,
    amqp_url_fixture,
    named_connections,
    rabbit_fixture,
)

ROOT = Path(__file__).resolve().parents[2]
PRODUCERS, EVENTS, KEYS = 3, 200, 20
KILLS = 3
"""SIGKILLs planned per role instance..."""
MIN_KILLS = 2
"""... and how many must have happened (a very slow machine may run out of CHAOS_LIMIT)."""
MIN_UPTIME = 2.0
"""Seconds a (re)started role lives at least before its next kill: it gets to work."""
IN_TRANSACTION = {"rabbit-relay": 0.75, "kafka-relay": 0.75}
"""Share of a role's kills that wait (up to IN_TRANSACTION_WAIT) for it to be idle inside a
database transaction: a relay waiting for a broker's confirmation before it marks its rows
(so it publishes them again), a handler or a producer before its commit. 0.5 for others."""
IN_TRANSACTION_WAIT = 3.0
CHAOS_LIMIT = 110.0
"""Seconds from the start by which every kill must have happened."""
DEADLINE = 150.0
"""Seconds from the start by which the pipeline must have settled."""
STALL = 30.0
"""Seconds without any progress after which the settling pipeline is declared stuck."""
CONNECTED_WAIT = 15.0
"""Seconds a connection-closing action waits for all its roles to be up, and then for
connections to close."""
STOP_TIMEOUT = 15.0
"""Seconds a role has to stop after SIGTERM."""
ORDER_REPORTS = 5
"""Keys detailed per hop when the order is wrong."""


@dataclass
class Instance:
    """One role instance, restarted after each kill; its log collects every incarnation."""

    role: str
    index: int
    command: list[str]
    log: Path
    thresholds: list[int]
    """Progress values of its hop at which it is killed, ascending."""
    in_transaction: list[bool]
    """For each threshold: whether that kill waits for the role to be in a transaction."""
    due_since: float | None = None
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    restart_at: float | None = None
    kills: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    """Exits nobody asked for."""
    done: bool = False
    """A producer that returned after committing all its events."""

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def start(self, now: float) -> None:
        with self.log.open("ab") as out:
            out.write(f"--- started at {now:.3f}\n".encode())
            self.process = subprocess.Popen(
                self.command,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        self.started, self.restart_at = now, None

    def tail(self, lines: int = 25) -> str:
        text_ = self.log.read_text(errors="replace").splitlines()
        return "\n".join(f"    | {line}" for line in text_[-lines:])


class Pipeline:
    """Starts, watches, kills and restarts the role processes."""

    def __init__(self, cfg: Chaos, logs: Path, rng: random.Random) -> None:
        self.cfg = cfg
        self.rng = rng
        self.t0 = time.monotonic()
        layout = [
            ("producer", PRODUCERS, (10, 170)),
            ("rabbit-relay", 2, (30, 570)),
            ("mid", 2, (30, 570)),
            ("kafka-relay", 1, (30, 570)),
            ("final", 2, (30, 570)),
        ]
        plans = [
            (role, index, _thresholds(rng, *span, KILLS))
            for role, count, span in layout
            for index in range(count)
        ]
        inside = [[rng.random() < IN_TRANSACTION.get(role, 0.5) for _ in range(KILLS)]
                  for role, _, _ in plans]  # fmt: skip
        # A producer holds at each of its thresholds until killed there (chaos_roles.produce).
        holds = [
            list(zip(marks, flags, strict=True))
            for (role, _, marks), flags in zip(plans, inside, strict=True)
            if role == "producer"
        ]
        raw = replace(cfg, producer_holds=holds).to_json()
        self.instances = [
            Instance(
                role,
                index,
                [sys.executable, "-m", "tests.support.chaos_roles", role, str(index), raw],
                logs / f"{role}-{index}.log",
                list(marks),
                flags,
            )
            for (role, index, marks), flags in zip(plans, inside, strict=True)
        ]
        self.events: list[str] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def note(self, what: str) -> None:
        line = f"{self.elapsed():6.1f}s {what}"
        self.events.append(line)
        print(line, flush=True)

    def start(self) -> None:
        for instance in self.instances:
            instance.start(self.elapsed())

    def tend(self, progress: Mapping[str, Any] | None, spare: Iterable[str] = ()) -> None:
        """Restart what died by itself; with ``progress``, kill what is due, except the roles
        in ``spare``."""
        now = self.elapsed()
        for inst in self.instances:
            if inst.process is not None and inst.process.poll() is not None:
                code = inst.process.returncode
                inst.process = None
                if inst.role == "producer" and code == 0:
                    inst.done = True
                    self.note(f"{inst.name} committed all its events")
                    continue
                inst.crashes.append(f"{inst.name} exited with {code} at {now:.1f}s:\n{inst.tail()}")
                self.note(f"{inst.name} EXITED BY ITSELF with {code}; restarting it")
                inst.restart_at = now + 0.2
            if inst.process is None and inst.restart_at is not None and now >= inst.restart_at:
                inst.start(now)
            if progress is None or inst.process is None or not inst.thresholds:
                continue
            if inst.role in spare:
                continue
            if progress[inst.name] < inst.thresholds[0] or now - inst.started < MIN_UPTIME:
                continue
            if inst.due_since is None:
                inst.due_since = now
            busy = inst.name in progress["in_transaction"]
            waited = now - inst.due_since >= IN_TRANSACTION_WAIT
            if inst.in_transaction[0] and not busy and not waited:
                continue
            pid = inst.process.pid
            os.kill(pid, signal.SIGKILL)
            inst.process.wait()
            inst.process = None
            inst.restart_at = now + self.rng.uniform(0.0, 0.5)
            inst.due_since = None
            mark, _ = inst.thresholds.pop(0), inst.in_transaction.pop(0)
            where = " in a transaction" if busy else ""
            inst.kills.append(f"at {now:.1f}s, progress {progress[inst.name]} (>= {mark}){where}")
            self.note(f"SIGKILL {inst.name} pid {pid} at progress {progress[inst.name]}{where}")

    def kills_pending(self) -> int:
        return sum(len(i.thresholds) for i in self.instances if not i.done)

    def pids(self, *roles: str) -> set[int]:
        return {i.process.pid for i in self.instances if i.role in roles and i.process is not None}

    def up(self, *roles: str, since: float) -> bool:
        """Whether every instance of ``roles`` has been running for ``since`` seconds."""
        now = self.elapsed()
        return all(
            i.process is not None and now - i.started >= since
            for i in self.instances
            if i.role in roles
        )

    def producers_done(self) -> bool:
        return all(i.done for i in self.instances if i.role == "producer")

    def stop(self) -> list[str]:
        """SIGTERM to every running role; those still running after STOP_TIMEOUT get SIGKILL.
        Returns what did not stop by itself."""
        running = [i for i in self.instances if i.process is not None]
        for inst in running:
            assert inst.process is not None
            inst.process.send_signal(signal.SIGTERM)
        stubborn = []
        deadline = time.monotonic() + STOP_TIMEOUT
        for inst in running:
            assert inst.process is not None
            try:
                code = inst.process.wait(max(0.1, deadline - time.monotonic()))
                self.note(f"{inst.name} stopped with {code}")
                if code not in (0, -signal.SIGTERM):
                    stubborn.append(f"{inst.name} ended with {code} after SIGTERM")
            except subprocess.TimeoutExpired:
                inst.process.send_signal(signal.SIGUSR1)  # its stacks into its log (chaos_roles)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    inst.process.wait(2.0)
                inst.process.kill()
                inst.process.wait()
                stubborn.append(
                    f"{inst.name} did not stop within {STOP_TIMEOUT:.0f}s of SIGTERM:\n"
                    + inst.tail(80)
                )
            inst.process = None
        return stubborn

    def kill_all(self) -> None:
        for inst in self.instances:
            if inst.process is not None:
                inst.process.kill()
                inst.process.wait()
                inst.process = None


def _thresholds(rng: random.Random, low: int, high: int, count: int) -> list[int]:
    """``count`` ascending values, one drawn in each of ``count`` equal slices of [low, high]."""
    width = (high - low) / count
    return [int(low + width * i + rng.uniform(0, width)) for i in range(count)]


def _die_with_parent() -> None:
    # Linux: a role gets SIGKILL when the test process dies, so no role outlives a killed run.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def close_rabbit_connections(tag: str) -> list[str]:
    """Close, from the broker side, every connection of this run (client-provided names
    start with ``tag``); other tests' connections are left alone. Returns their names."""
    ctl = shutil.which("rabbitmqctl")
    assert ctl is not None
    found: list[tuple[str, str]] = []
    deadline = time.monotonic() + CONNECTED_WAIT
    while not found and time.monotonic() < deadline:
        found = [(pid, name) for pid, name in named_connections(ctl) if name.startswith(tag)]
    closing = [
        subprocess.Popen([ctl, "close_connection", pid, "chaos"], stdout=subprocess.DEVNULL)
        for pid, _ in found
    ]
    for process in closing:
        process.wait(60)
    return [name for _, name in found]


def reset_tcp_connections(pids: set[int], spare_port: int) -> list[str]:
    """Reset (``ss -K``) the established TCP connections of ``pids``, except those to
    ``spare_port`` (the database). Needs CAP_NET_ADMIN; returns the connections reset."""
    if shutil.which("ss") is None:
        return []
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, timeout=30
    ).stdout
    reset = []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 5 or not {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids:
            continue
        local, peer = parts[2], parts[3]
        sport, dport = local.rsplit(":", 1)[1], peer.rsplit(":", 1)[1]
        if int(dport) == spare_port:
            continue
        done = subprocess.run(
            ["ss", "-tnK", f"sport = :{sport} and dport = :{dport}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if done.returncode == 0 and len(done.stdout.splitlines()) > 1:
            reset.append(f"{local}->{peer}")
    return reset


class Background:
    """A chaos action run once in a thread (rabbitmqctl takes seconds)."""

    def __init__(self, what: str, roles: tuple[str, ...], threshold: int) -> None:
        self.what = what
        self.roles = roles
        """The roles whose connections it closes: spared from kills meanwhile."""
        self.threshold = threshold
        self.due_since: float | None = None
        self.thread: threading.Thread | None = None
        self.result: list[str] | None = None
        self.error: BaseException | None = None

    def fire(self, action: Any, *args: Any) -> None:
        def run() -> None:
            try:
                self.result = action(*args)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    @property
    def finished(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    @property
    def sparing(self) -> bool:
        """From its threshold until it is done, its roles are not killed: they get connected."""
        return self.due_since is not None and not self.finished

    def due(self, pipeline: Pipeline, progress: int) -> bool:
        """Once ``progress`` reached the threshold, as soon as all its roles are up (they
        have connections to close), or after CONNECTED_WAIT seconds anyway."""
        if self.thread is not None or progress < self.threshold:
            return False
        now = pipeline.elapsed()
        if self.due_since is None:
            self.due_since = now
        return pipeline.up(*self.roles, since=MIN_UPTIME) or now - self.due_since > CONNECTED_WAIT


def progress_of(db: Any, cfg: Chaos, pipeline: Pipeline | None = None) -> dict[str, Any]:
    """How far each hop is, keyed by role instance name (what its kill thresholds read)
    and by hop; ``in_transaction``: the roles inside a transaction now (MySQL: found
    through ``pipeline``'s processes)."""
    t = cfg.table
    producers = dict(rows(db, f"SELECT producer, count(*) FROM {t('produced')} GROUP BY producer"))
    hops = []
    for outbox, effects in (("outbox", "mid_effects"), ("outbox_kafka", "final_effects")):
        sql = (
            f"SELECT (SELECT count(published_at) FROM {t(outbox)}), "
            f"(SELECT count(*) - count(published_at) FROM {t(outbox)}), "
            f"(SELECT count(DISTINCT id) FROM {t(effects)})"
        )
        hops.append(tuple(int(v) for v in rows(db, sql)[0]))
    (relayed, backlog, mid), (relayed_kafka, backlog_kafka, final) = hops
    out: dict[str, Any] = {f"producer-{p}": int(producers.get(p, 0)) for p in range(cfg.producers)}
    out.update({f"rabbit-relay-{i}": relayed for i in range(2)})
    out.update({f"mid-{i}": mid for i in range(2)})
    out["kafka-relay-0"] = relayed_kafka
    out.update({f"final-{i}": final for i in range(2)})
    out.update(backlog=backlog, backlog_kafka=backlog_kafka, mid=mid, final=final)
    out["produced"] = sum(int(v) for v in producers.values())
    # Roles inside a transaction and busy elsewhere now: a relay waiting for a broker's
    # confirmation, a handler between two statements, a producer between its insert and
    # its commit.
    if cfg.mysql:
        out["in_transaction"] = mysql_in_transaction(db, pipeline)
        return out
    busy = rows(  # PostgreSQL: connections are named "{tag}:{role}-{index}"
        db,
        "SELECT DISTINCT application_name FROM pg_stat_activity "
        f"WHERE application_name LIKE '{cfg.tag}:%' AND state = 'idle in transaction'",
    )
    out["in_transaction"] = {r.application_name.split(":", 1)[1] for r in busy}
    return out


def mysql_in_transaction(db: Any, pipeline: Pipeline | None) -> set[str]:
    """MySQL/MariaDB: the role instances with a session idle inside an InnoDB transaction
    in the test's database. A session has no name there: its client port (PROCESSLIST's
    HOST) is matched to the role process that holds that socket (``ss -tnp``)."""
    if pipeline is None or shutil.which("ss") is None:
        return set()
    ports = {
        str(r.HOST).rsplit(":", 1)[-1]
        for r in rows(
            db,
            "SELECT p.HOST FROM information_schema.INNODB_TRX t "
            "JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id "
            "WHERE p.COMMAND = 'Sleep' AND p.DB = DATABASE()",
        )
    }
    if not ports:
        return set()
    names = {i.process.pid: i.name for i in pipeline.instances if i.process is not None}
    listing = subprocess.run(
        ["ss", "-tnpH", "state", "established"], capture_output=True, text=True, timeout=30
    ).stdout
    busy = set()
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 4 or parts[2].rsplit(":", 1)[-1] not in ports:
            continue
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in names:
                busy.add(names[int(pid)])
    return busy


def rows(pg: Any, sql: str) -> list[Any]:
    with pg.engine.connect() as conn:
        return list(conn.execute(text(sql)))


def exactly_once(hop: str, seen: Iterable[str], expected: Iterable[str]) -> list[str]:
    """Problems: ids missing, applied more than once, or unknown at ``hop``."""
    counts = Counter(seen)
    wanted = set(expected)
    missing = sorted(wanted - set(counts))
    doubled = {i: c for i, c in sorted(counts.items()) if c > 1}
    unknown = sorted(set(counts) - wanted)
    problems = []
    if missing:
        problems.append(f"{hop}: {len(missing)} ids missing: {_some(missing)}")
    if doubled:
        shown = ", ".join(f"{i} x{c}" for i, c in list(doubled.items())[:20])
        problems.append(f"{hop}: {len(doubled)} ids applied more than once: {shown}")
    if unknown:
        problems.append(f"{hop}: {len(unknown)} unknown ids: {_some(unknown)}")
    return problems


def in_order(
    hop: str,
    expected: Mapping[str, list[str]],
    seen: Iterable[tuple[str, str]],
    names: Mapping[str, str],
) -> list[str]:
    """Problems: per key, the first occurrences of the ``seen`` (key, event_id) pairs must
    come in ``expected[key]``'s order (the outbox order); events never seen are reported too.
    Events are shown by their business id (``names``); at most ORDER_REPORTS keys."""
    firsts: dict[str, list[str]] = defaultdict(list)
    met: set[str] = set()
    for key, event in seen:
        if event not in met:
            met.add(event)
            firsts[key].append(event)
    problems = []
    for key, want in sorted(expected.items()):
        got = firsts.get(key, [])
        if got == want:
            continue
        lost = [names.get(e, e) for e in want if e not in met]
        if lost:
            problems.append(f"{hop}: key {key}: {len(lost)} events never seen: {_some(lost)}")
            continue
        pairs = enumerate(zip(got, want, strict=False))
        i = next((i for i, (a, b) in pairs if a != b), min(len(got), len(want)))
        problems.append(
            f"{hop}: key {key} out of order at its event #{i}: outbox order "
            f"{[names.get(e, e) for e in want[max(0, i - 2) : i + 3]]}, seen first in the "
            f"order {[names.get(e, e) for e in got[max(0, i - 2) : i + 3]]}"
        )
    if len(problems) > ORDER_REPORTS:
        more = len(problems) - ORDER_REPORTS
        problems = [*problems[:ORDER_REPORTS], f"{hop}: ... and {more} more keys"]
    return problems


def _some(items: Sequence[Any], count: int = 20) -> str:
    more = f" ... (+{len(items) - count})" if len(items) > count else ""
    return ", ".join(map(str, items[:count])) + more


@pytest.fixture(params=["postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """Every table of the run in one schema of its own: PostgreSQL, or a database of its own
    on MariaDB (issue 34: the same chaos, PyMySQL and aiomysql)."""
    yield from database(request, request.param, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(220)
@pytest.mark.parametrize("offsets", ["broker", "database"])
async def test_chaos_every_role_killed_each_effect_exactly_once_in_key_order(
    db: Any,
    kafka: KafkaService,
    topics: Topics,
    rabbit: Broker,
    amqp_url: str,
    tmp_path: Path,
    offsets: str,
) -> None:
    services.tool("rabbitmqctl", "the chaos test closes its RabbitMQ connections from the broker")
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    print(f"\nCHAOS_SEED={seed} (set it to replay this schedule)", flush=True)
    rng = random.Random(seed)
    tag = f"chaos-{uuid.uuid4().hex[:10]}"

    # Topology: a fanout exchange feeding the work queue and a tap queue the test reads at
    # the end (the order the relays published in); a Kafka topic with 4 partitions.
    exchange = rabbit.name("chaos-x")
    work = rabbit.queue("chaos-work")
    tap = rabbit.queue("chaos-tap", dead_letter=False)
    channel = rabbit.channel
    channel.exchange_declare(exchange, exchange_type="fanout", durable=True)
    channel.queue_bind(work, exchange)
    channel.queue_bind(tap, exchange)
    topic = await topics.create("chaos", partitions=4)
    cfg = Chaos(
        tag=tag,
        seed=seed,
        db_url=db.url,
        async_url=db.async_url,
        schema=db.schema,
        amqp_url=amqp_url,
        exchange=exchange,
        work_queue=work,
        bootstrap=kafka.bootstrap,
        topic=topic,
        group=f"{tag}-final",
        idempotence=kafka.idempotence,
        group_options=dict(kafka.group_options),
        producers=PRODUCERS,
        events=EVENTS,
        keys=KEYS,
        offsets=offsets,
    )
    tables, kafka_tables = cfg.tables()
    install(db.engine, tables)
    install(db.engine, kafka_tables)
    create_business_tables(db.engine, db.schema)
    db_port = make_url(db.url).port or (3306 if cfg.mysql else 5432)

    pipeline = Pipeline(cfg, tmp_path, rng)
    rabbit_close = Background(
        "close this run's RabbitMQ connections", ("rabbit-relay", "mid"), rng.randint(150, 400)
    )
    kafka_reset = Background(
        "reset the Kafka roles' broker connections", ("kafka-relay", "final"), rng.randint(150, 400)
    )
    print("kill thresholds:", {i.name: i.thresholds for i in pipeline.instances}, flush=True)
    timings: dict[str, float] = {}
    settled = False
    lag: int | None = None
    progress: dict[str, Any] = {}
    try:
        pipeline.start()
        # Chaos: kill each role at its thresholds, close the broker connections once.
        while pipeline.elapsed() < CHAOS_LIMIT:
            progress = progress_of(db, cfg, pipeline)
            spare = [
                r for action in (rabbit_close, kafka_reset) if action.sparing for r in action.roles
            ]
            pipeline.tend(progress, spare)
            if rabbit_close.due(pipeline, progress["mid"]):
                pipeline.note(f"{rabbit_close.what} (mid progress {progress['mid']})")
                rabbit_close.fire(close_rabbit_connections, tag)
            if kafka_reset.due(pipeline, progress["final"]):
                pids = pipeline.pids("kafka-relay", "final")
                pipeline.note(f"{kafka_reset.what} (final progress {progress['final']})")
                kafka_reset.fire(reset_tcp_connections, pids, db_port)
            if pipeline.kills_pending() == 0 and rabbit_close.finished and kafka_reset.finished:
                break
            await asyncio.sleep(0.1)
        timings["chaos"] = pipeline.elapsed()
        pipeline.note(f"chaos over; {pipeline.kills_pending()} planned kills not done")

        # Settle: no more kills; wait until every hop is done and the brokers are drained.
        last_change, last_seen = pipeline.elapsed(), None
        while pipeline.elapsed() < DEADLINE:
            progress = progress_of(db, cfg)
            pipeline.tend(None)
            seen = {k: v for k, v in progress.items() if k != "in_transaction"}
            if seen != last_seen:
                last_change, last_seen = pipeline.elapsed(), seen
            elif pipeline.elapsed() - last_change > STALL:
                pipeline.note(f"no progress for {STALL:.0f}s: stuck")
                break
            total = PRODUCERS * EVENTS
            if (
                pipeline.producers_done()
                and progress["produced"] == total
                and progress["backlog"] == 0
                and progress["mid"] == total
                and progress["backlog_kafka"] == 0
                and progress["final"] == total
            ):
                lag = await topics.lag(cfg.group, topic)
                if lag == 0 and rabbit.ready(work) == 0:
                    settled = True
                    break
            await asyncio.sleep(0.5)
        timings["settled"] = pipeline.elapsed()
        pipeline.note(f"settled: {settled}; progress {progress}")
        stubborn = pipeline.stop()
        timings["stopped"] = pipeline.elapsed()
    finally:
        pipeline.kill_all()

    problems, per_key, names = verify(db, cfg, rabbit, work, tap)
    problems += await verify_kafka(cfg, topics, per_key["outbox_kafka"], names)
    if not settled:
        measured = "not measured" if lag is None else lag
        problems.insert(0, f"did not settle (Kafka lag {measured}); last progress {progress}")
    problems += stubborn
    for inst in pipeline.instances:
        if len(inst.kills) < MIN_KILLS:
            problems.append(
                f"chaos incomplete: {inst.name} killed {len(inst.kills)} times, "
                f"{KILLS} planned, {MIN_KILLS} needed"
            )
        problems += inst.crashes
    for action in (rabbit_close,):
        if action.error is not None or not action.result:
            problems.append(f"could not {action.what}: {action.error or 'no connection found'}")
    print(f"RabbitMQ connections closed: {rabbit_close.result}; error {rabbit_close.error}")
    for inst in pipeline.instances:
        lines = inst.log.read_text(errors="replace").splitlines()
        noted = Counter(w for line in lines for w in ("WARNING", "ERROR") if f" {w} " in line)
        print(f"{inst.name}: {len(inst.kills)} kills, log {dict(noted)}")
    print(f"Kafka connections reset: {kafka_reset.result}; error {kafka_reset.error}")
    print(f"timings: {timings}; kills: {sum(len(i.kills) for i in pipeline.instances)}")
    report = "\n".join(f"- {p}" for p in problems)
    assert not problems, (
        f"CHAOS_SEED={seed}: {len(problems)} problems (role logs in {tmp_path}):\n{report}\n"
        "chaos log:\n" + "\n".join(pipeline.events)
    )


def verify(
    pg: Any, cfg: Chaos, rabbit: Broker, work: str, tap: str
) -> tuple[list[str], dict[str, dict[str, list[str]]], dict[str, str]]:
    """Every check on the database and RabbitMQ: the problems found, each outbox's event
    ids per key in outbox order, and the business id of each event id."""
    t = cfg.table
    expected = cfg.expected()
    problems = exactly_once(
        "producers (table produced)",
        [r.id for r in rows(pg, f"SELECT id FROM {t('produced')}")],
        expected,
    )

    per_key: dict[str, dict[str, list[str]]] = {}
    events: dict[str, set[str]] = {}
    names: dict[str, str] = {}
    for outbox in ("outbox", "outbox_kafka"):
        found = rows(
            pg,
            "SELECT o.event_id, o.key, o.body, o.published_at, o.attempts, o.last_error "
            f"FROM {t(outbox)} o ORDER BY o.id",
        )
        bodies = [json.loads(bytes(r.body)) for r in found]
        problems += exactly_once(
            f"{outbox} (events per business id)", [b["id"] for b in bodies], expected
        )
        wrong_key = [
            b["id"] for r, b in zip(found, bodies, strict=True) if r.key != expected.get(b["id"])
        ]
        if wrong_key:
            problems.append(f"{outbox}: events with the wrong key: {_some(wrong_key)}")
        unpublished = [
            f"{r.event_id} ({r.attempts} attempts: {r.last_error})"
            for r in found
            if r.published_at is None
        ]
        if unpublished:
            problems.append(
                f"{outbox}: {len(unpublished)} rows never published: {_some(unpublished, 10)}"
            )
        parked = [r.event_id for r in found if r.attempts >= RELAY.max_attempts]
        if parked:
            problems.append(f"{outbox}: {len(parked)} rows parked: {_some(parked)}")
        order: dict[str, list[str]] = defaultdict(list)
        for r, body in zip(found, bodies, strict=True):
            order[r.key].append(r.event_id)
            names[r.event_id] = body["id"]
        per_key[outbox] = order
        events[outbox] = {r.event_id for r in found}

    for hop, consumer, outbox in (
        ("mid_effects", MID_CONSUMER, "outbox"),
        ("final_effects", FINAL_CONSUMER, "outbox_kafka"),
    ):
        problems += exactly_once(
            f"{hop} (business rows of the {consumer} consumers)",
            [r.id for r in rows(pg, f"SELECT id FROM {t(hop)}")],
            expected,
        )
        records = rows(
            pg,
            f"SELECT message_id, outcome FROM {t('processed_events')} "
            f"WHERE consumer = '{consumer}'",
        )
        problems += exactly_once(
            f"processed_events of {consumer} (per event_id)",
            [r.message_id for r in records],
            events[outbox],
        )
        not_processed = Counter(r.outcome for r in records if r.outcome != "processed")
        if not_processed:
            problems.append(f"processed_events of {consumer}: outcomes {dict(not_processed)}")

    # The Kafka consumers apply a key's events in outbox order (one partition per key).
    applied = rows(pg, f"SELECT ekey, event_id FROM {t('final_effects')} ORDER BY seq")
    problems += in_order(
        "final_effects (order applied)",
        per_key["outbox_kafka"],
        [(r.ekey, r.event_id) for r in applied],
        names,
    )

    # RabbitMQ: nothing left (no consumer is attached any more: unacked came back).
    left = rabbit.held(work)
    if left:
        problems.append(f"RabbitMQ: {left} messages left in {work}")
    dead = rabbit.held(work + ".dlq")
    if dead:
        problems.append(f"RabbitMQ: {dead} dead letters in {work}.dlq")
    # The relays published each key in outbox order: the tap queue saw what they sent.
    published = [(json.loads(body)["key"], props.message_id) for props, body in rabbit.peek(tap)]
    print(f"RabbitMQ: {len(published)} publications for {len(events['outbox'])} events")
    problems += in_order("RabbitMQ publications (tap queue)", per_key["outbox"], published, names)
    return problems, per_key, names


async def verify_kafka(
    cfg: Chaos, topics: Topics, per_key: Mapping[str, list[str]], names: Mapping[str, str]
) -> list[str]:
    """Kafka: the group caught up, no dead letter, each key in one partition, published in
    outbox order."""
    problems = []
    lag = await topics.lag(cfg.group, cfg.topic)
    if lag:
        committed = await topics.committed(cfg.group, cfg.topic)
        ends = await topics.ends(cfg.topic)
        problems.append(
            f"Kafka: group {cfg.group} is {lag} behind: committed {committed}, ends {ends}"
        )
    dead = await topics.records(cfg.topic + ".dlq")
    if dead:
        problems.append(f"Kafka: {len(dead)} dead letters in {cfg.topic}.dlq")
    records = await topics.records(cfg.topic)
    partitions: dict[str, set[int]] = defaultdict(set)
    published = []
    for record in records:
        key = record.key.decode()
        partitions[key].add(record.partition)
        published.append((key, dict(record.headers)["event_id"].decode()))
    split = {k: sorted(p) for k, p in partitions.items() if len(p) > 1}
    if split:
        problems.append(f"Kafka: keys in more than one partition: {split}")
    print(f"Kafka: {len(records)} records")
    problems += in_order("Kafka publications (topic, per partition)", per_key, published, names)
    return problems
