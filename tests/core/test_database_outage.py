"""The database going away mid-stream: retried, resumed, nothing lost or doubled."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner

VICTIM = "consumerdedup-outage-victim"


def test_connection_killed_inside_the_handler_is_retried_once(pg: Any) -> None:
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, consumer="ledger", tables=pg.tables)
    calls: list[int] = []

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )
        calls.append(1)
        if len(calls) == 1:  # the server drops this very connection mid-transaction
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    result = handle.process(Message(id="m-1", body=b"{}"))
    assert result.outcome is Outcome.PROCESSED and result.attempts == 2
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1


def test_connections_killed_repeatedly_mid_stream_lose_nothing(pg: Any) -> None:
    """Kills land mid-transaction by construction: at each cue id's first delivery the
    handler, its INSERT done, hands over to the killer and waits until every connection of
    the consumer is gone (``pg_terminate_backend``'s wait). A killer on a timer (every 0.15
    s) once hit none: on a loaded machine its shots fell while the runner was between
    connections, in a retry's pause, and 'at least 3 kills' failed on the scheduler's luck."""
    ledger = pg.create_ledger()
    engine = create_engine(pg.url, connect_args={"application_name": VICTIM}, pool_size=2)
    dedup = Deduplicator(engine, consumer="ledger", tables=pg.tables)
    cues = {"m-0003", "m-0050", "m-0051", "m-0199", "m-0333", "m-0399"}  # 50, 51: back to back
    cue_ids = sorted(cues)
    calls: list[str] = []
    cued = threading.Event()
    killed = threading.Event()
    kills: list[int] = []

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )
        calls.append(message.id)
        if message.id in cues:  # once: its retry runs through
            cues.discard(message.id)
            killed.clear()
            cued.set()
            assert killed.wait(60), "the killer never came"  # a hang guard, not a bound

    broker = MemoryBroker(duplicate_rate=0.1, seed=3)
    total = 400
    for i in range(total):
        broker.publish("payments", json.dumps({"n": i}).encode(), message_id=f"m-{i:04d}")
    pause = timedelta(milliseconds=50)  # no doubling: the outage is over within a few
    config = MemoryConfig(batch_size=5, retry_delay=pause, max_retry_delay=pause)
    runner = MemoryConsumerRunner(handle, "payments", broker=broker, config=config)
    done = threading.Event()

    def killer() -> None:
        with pg.engine.connect() as conn:
            while True:
                cued.wait()
                cued.clear()
                if done.is_set():
                    return
                killed_now = conn.execute(
                    text(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) "
                        "FROM pg_stat_activity WHERE application_name = :name"
                    ),
                    {"name": VICTIM},
                ).scalar()
                conn.rollback()
                kills.append(int(killed_now or 0))
                killed.set()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        runner.run(until_idle=True)
        while broker.held("payments"):  # RETRY outcomes were given back: drain them too
            runner.run(until_idle=True)
    finally:
        done.set()
        cued.set()
        thread.join(60)
        engine.dispose()

    assert len(kills) == 6 and min(kills) >= 1, kills  # each cue killed its own connection
    assert all(calls.count(mid) >= 2 for mid in cue_ids), calls  # mid-transaction: run again
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == total
    assert pg.scalar(f"SELECT count(DISTINCT message_id) FROM {ledger}") == total
    assert pg.scalar(f"SELECT sum(amount) FROM {ledger}") == sum(range(total))
    assert broker.held("payments") == 0
    assert broker.messages("payments.dlq") == []


def test_a_connection_killed_during_the_start_checks_is_an_outage_not_a_setup_fault(
    pg: Any,
) -> None:
    """The start checks' connection dies under them (the flake of the stream test above,
    made certain): a WARN for the doctor; the runner checks again after a backoff, then
    runs. Before, the lost connection's OperationalError came out of ``run()``."""
    from sqlalchemy import event

    from consumerdedup.doctor import WARN, startup_checks

    ledger = pg.create_ledger()
    engine = create_engine(pg.url, pool_size=1, max_overflow=0)
    kills = {"left": 2}  # startup_checks, then the runner's: each loses its connection

    @event.listens_for(engine, "before_cursor_execute")
    def kill_first(conn: Any, *_args: Any) -> None:
        if kills["left"] and not conn.info.get("killed"):
            kills["left"] -= 1
            conn.info["killed"] = True
            conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")

    found = {c.name: c.status for c in startup_checks(engine, pg.tables)}
    assert found["database"] == WARN, found
    dedup = Deduplicator(engine, consumer="ledger", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )

    broker = MemoryBroker()
    broker.publish("payments", b"{}", message_id="m-1")
    MemoryConsumerRunner(handle, "payments", broker=broker).run(until_idle=True)
    event.remove(engine, "before_cursor_execute", kill_first)
    engine.dispose()
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1
    assert kills["left"] == 0
