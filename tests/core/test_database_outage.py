"""The database going away mid-stream: retried, resumed, nothing lost or doubled."""

from __future__ import annotations

import json
import threading
import time
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
    ledger = pg.create_ledger()
    engine = create_engine(pg.url, connect_args={"application_name": VICTIM}, pool_size=2)
    dedup = Deduplicator(engine, consumer="ledger", tables=pg.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :m)"),
            {"n": message.json()["n"], "m": message.id},
        )
        time.sleep(0.002)  # widen the window in which a kill lands mid-transaction

    broker = MemoryBroker(duplicate_rate=0.1, seed=3)
    total = 400
    for i in range(total):
        broker.publish("payments", json.dumps({"n": i}).encode(), message_id=f"m-{i:04d}")
    pause = timedelta(milliseconds=50)  # no doubling: the outage is over within a few
    config = MemoryConfig(batch_size=5, retry_delay=pause, max_retry_delay=pause)
    runner = MemoryConsumerRunner(handle, "payments", broker=broker, config=config)
    kills: list[int] = []

    def killer() -> None:
        for _ in range(8):
            time.sleep(0.15)
            with pg.engine.connect() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :name"
                    ),
                    {"name": VICTIM},
                ).scalar()
            kills.append(int(killed or 0))

    thread = threading.Thread(target=killer)
    thread.start()
    runner.run(until_idle=True)
    thread.join()
    while broker.held("payments"):  # RETRY outcomes were given back: drain them too
        runner.run(until_idle=True)
    engine.dispose()

    assert sum(kills) >= 3, f"the killer hit too few connections: {kills}"
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == total
    assert pg.scalar(f"SELECT count(DISTINCT message_id) FROM {ledger}") == total
    assert pg.scalar(f"SELECT sum(amount) FROM {ledger}") == sum(range(total))
    assert broker.held("payments") == 0
    assert broker.messages("payments.dlq") == []


def test_a_connection_killed_during_the_start_checks_is_an_outage_not_a_setup_fault(
    pg: Any,
) -> None:
    """The start checks' connection dies under them (the flake of the stream test above,
    made certain): a WARN the process's own retry takes from there, then the runner runs.
    Before, the lost connection's OperationalError came out of ``run()``."""
    from sqlalchemy import event

    from consumerdedup.doctor import WARN, require_startup, startup_checks

    ledger = pg.create_ledger()
    engine = create_engine(pg.url, pool_size=1, max_overflow=0)
    kills = {"left": 2}  # startup_checks, then require_startup: each loses its connection

    @event.listens_for(engine, "before_cursor_execute")
    def kill_first(conn: Any, *_args: Any) -> None:
        if kills["left"] and not conn.info.get("killed"):
            kills["left"] -= 1
            conn.info["killed"] = True
            conn.exec_driver_sql("SELECT pg_terminate_backend(pg_backend_pid())")

    found = {c.name: c.status for c in startup_checks(engine, pg.tables)}
    assert found["database"] == WARN, found
    require_startup(engine, pg.tables)  # raises nothing: an outage is the retry's to judge
    event.remove(engine, "before_cursor_execute", kill_first)
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
    engine.dispose()
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1
    assert kills["left"] == 0
