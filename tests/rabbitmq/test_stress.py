"""The issue's scenarios on the real broker and PostgreSQL: duplicates, a runner killed with
SIGKILL, a crash between commit and ack, the connection closed from the broker side."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from consumerdedup import Deduplicator, Message, Outcome, Result, SimulatedCrash, Tables
from consumerdedup.adapters.rabbitmq import RabbitConfig, RabbitConsumerRunner
from tests.support.rabbitmq_service import (  # noqa: F401
    Broker,
    amqp_url_fixture,
    close_connection,
    rabbit_fixture,
)

SPAWN = multiprocessing.get_context("spawn")


def runner_for(
    engine: Any,
    tables: Tables,
    ledger: str,
    queue: str,
    url: str,
    *,
    worker: str = "w",
    seen: list[Result] | None = None,
    slow: float = 0.0,
    hold_at: int = 0,
    **config: Any,
) -> RabbitConsumerRunner:
    """A runner whose handler inserts one ledger row per message (``account`` = ``worker``).
    ``hold_at``: its call of that number never returns (the process is to be killed)."""
    observers = [seen.append] if seen is not None else []
    dedup = Deduplicator(engine, consumer="ledger", tables=tables, observers=observers)
    calls: list[str] = []

    @dedup.handler
    def apply(message: Message, session: Any) -> None:
        data = message.json()
        calls.append(message.id)
        if len(calls) == hold_at:
            threading.Event().wait()  # mid-batch, its deliveries unacked, until SIGKILL
        if slow:
            time.sleep(slow)
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:w, :n, :m)"),
            {"w": worker, "n": data["amount"], "m": message.id},
        )

    config.setdefault("idle_timeout", timedelta(milliseconds=500))
    return RabbitConsumerRunner(apply, queue, url=url, config=RabbitConfig(**config))


def ledger_rows(db: Any, ledger: str) -> tuple[int, int]:
    """(rows, distinct message ids) of the ledger."""
    with db.engine.connect() as conn:
        row = conn.exec_driver_sql(f"SELECT count(*), count(DISTINCT message_id) FROM {ledger}")
        count, distinct = row.one()
    return int(count), int(distinct)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def publish_ids(rabbit: Broker, queue: str, ids: list[str]) -> None:
    for mid in ids:
        rabbit.publish(queue, json.dumps({"amount": 1}).encode(), message_id=mid)


@pytest.mark.slow
@pytest.mark.parametrize("batch_size", [1, 50])
def test_5000_messages_30_percent_published_twice_give_5000_effects(
    pg: Any, rabbit: Broker, batch_size: int
) -> None:
    ledger = pg.create_ledger()
    queue = rabbit.queue("dups")
    ids = [f"pay-{i:05d}" for i in range(5000)]
    twice = set(random.Random(4).sample(ids, 1500))
    deliveries = ids + sorted(twice)
    random.Random(5).shuffle(deliveries)
    publish_ids(rabbit, queue, deliveries)

    runner = runner_for(
        pg.engine, pg.tables, ledger, queue, rabbit.url, prefetch=100, batch_size=batch_size
    )
    runner.run(until_idle=True)

    assert ledger_rows(pg, ledger) == (5000, 5000)
    assert runner.outcomes == Counter({Outcome.PROCESSED: 5000, Outcome.DUPLICATE: 1500})
    assert pg.scalar(f"SELECT count(*) FROM {pg.tables.processed_events.fullname}") == 5000
    assert rabbit.held(queue) == 0


def consume_until_signalled(
    url: str, db_url: str, names: tuple[str, str], ledger: str, queue: str, worker: str, out: str
) -> None:
    """Child: consume until SIGTERM, then write its outcome counts and redeliveries to ``out``."""
    engine = create_engine(db_url)
    seen: list[Result] = []
    runner = runner_for(
        engine,
        Tables.define(*names),
        ledger,
        queue,
        url,
        worker=worker,
        seen=seen,
        slow=0.004,
        hold_at=100 if worker == "a" else 0,  # killed mid-stream by construction
        prefetch=40,
        batch_size=10,
        connection_name=f"{queue}-{worker}",
    )
    runner.on_signals()
    runner.run()
    redelivered = sum(1 for r in seen if r.message.raw.method.redelivered)
    outcomes = {o.value: n for o, n in runner.outcomes.items()}
    Path(out).write_text(json.dumps({"outcomes": outcomes, "redelivered": redelivered}))
    engine.dispose()


@pytest.mark.slow
def test_three_runners_one_killed_mid_stream_apply_each_message_once(
    pg: Any, rabbit: Broker, tmp_path: Path
) -> None:
    total = 3000
    ledger = pg.create_ledger()
    queue = rabbit.queue("kill")
    names = (pg.tables.processed_events.fullname, pg.tables.outbox.fullname)
    children = {}
    for worker in ("a", "b", "c"):
        args = (rabbit.url, pg.url, names, ledger, queue, worker, str(tmp_path / worker))
        children[worker] = SPAWN.Process(target=consume_until_signalled, args=args)
        children[worker].start()

    def rows_by(worker: str) -> int:
        sql = f"SELECT count(*) FROM {ledger} WHERE account = '{worker}'"
        return int(pg.scalar(sql))

    def consumers() -> int:
        return int(rabbit.channel.queue_declare(queue, passive=True).method.consumer_count)

    # The messages come once all three consume: the queue hands each its share (published
    # before, the first runners could take all 3,000 while a slow spawn was still starting,
    # and 'runner c to get going' waited out its guard).
    wait_for(lambda: consumers() == 3, 120, "the three runners to consume the queue")
    publish_ids(rabbit, queue, [f"pay-{i:05d}" for i in range(total)])
    for worker in children:  # all three consuming side by side
        wait_for(lambda w=worker: rows_by(w) >= 50, 120, f"runner {worker} to get going")
    children["a"].kill()  # SIGKILL: no cleanup, its unacked deliveries go back to the queue
    children["a"].join(30)
    assert children["a"].exitcode == -signal.SIGKILL
    assert ledger_rows(pg, ledger)[1] < total, "runner a was killed too late to test anything"

    wait_for(lambda: ledger_rows(pg, ledger)[1] == total, 180, "every message to be applied")
    for worker in ("b", "c"):
        os.kill(children[worker].pid, signal.SIGTERM)  # graceful: finish, commit, ack, close
    for worker in ("b", "c"):
        children[worker].join(60)
        assert children[worker].exitcode == 0

    assert ledger_rows(pg, ledger) == (total, total)
    assert pg.scalar(f"SELECT count(*) FROM {pg.tables.processed_events.fullname}") == total
    assert rabbit.held(queue) == 0
    reports = [json.loads((tmp_path / w).read_text()) for w in ("b", "c")]
    assert sum(r["redelivered"] for r in reports) > 0, "a's unacked messages were not redelivered"
    assert all(r["outcomes"].get("failed", 0) == 0 for r in reports)


def test_a_crash_between_commit_and_ack_redelivers_the_batch_as_duplicates(
    pg: Any, rabbit: Broker
) -> None:
    ledger = pg.create_ledger()
    queue = rabbit.queue("crash")
    publish_ids(rabbit, queue, [f"pay-{i:03d}" for i in range(100)])
    batches: list[list[str]] = []

    def die_on_third_batch(results: Any) -> None:
        batches.append([r.message.id for r in results])
        if len(batches) == 3:
            raise SimulatedCrash("killed after the commit of batch 3, before its acks")

    crashing = runner_for(pg.engine, pg.tables, ledger, queue, rabbit.url, batch_size=10)
    crashing.before_ack = die_on_third_batch
    with pytest.raises(SimulatedCrash):
        crashing.run(until_idle=True)
    committed = sum(len(batch) for batch in batches)
    assert ledger_rows(pg, ledger) == (committed, committed)  # three batches committed...
    assert rabbit.held(queue) == 100 - committed + len(batches[2])  # ...the third never acked

    seen: list[Result] = []
    restarted = runner_for(
        pg.engine, pg.tables, ledger, queue, rabbit.url, batch_size=10, seen=seen
    )
    restarted.run(until_idle=True)

    duplicates = [r.message.id for r in seen if r.outcome is Outcome.DUPLICATE]
    assert duplicates == batches[2]
    assert all(r.message.raw.method.redelivered for r in seen if r.message.id in batches[2])
    assert ledger_rows(pg, ledger) == (100, 100)
    assert rabbit.held(queue) == 0


@pytest.mark.parametrize("batch_size", [1, 20])
def test_the_connection_closed_by_the_broker_mid_stream_is_reopened_and_nothing_is_lost(
    pg: Any, rabbit: Broker, batch_size: int
) -> None:
    total = 1500
    ledger = pg.create_ledger()
    queue = rabbit.queue("close")
    publish_ids(rabbit, queue, [f"pay-{i:05d}" for i in range(total)])
    runner = runner_for(
        pg.engine,
        pg.tables,
        ledger,
        queue,
        rabbit.url,
        slow=0.002,
        batch_size=batch_size,
        reconnect_delay=timedelta(milliseconds=100),
        connection_name=f"{queue}-runner",
    )
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        for step in (200, 700):
            wait_for(lambda n=step: ledger_rows(pg, ledger)[0] >= n, 120, f"{step} rows")
            close_connection(rabbit.url, runner.name, "closed by the test, mid-stream")
        wait_for(lambda: ledger_rows(pg, ledger)[1] == total, 120, "every message")
    finally:
        runner.stop()
        thread.join(30)
    assert not thread.is_alive()
    assert runner.reconnects >= 2
    assert ledger_rows(pg, ledger) == (total, total)
    assert rabbit.held(queue) == 0
