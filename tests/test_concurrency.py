"""Racing duplicates across processes and processes killed mid-pipeline."""

from __future__ import annotations

import json
import multiprocessing
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outcome
from tests import workers
from tests.conftest import Database, database

SPAWN = multiprocessing.get_context("spawn")
WORKERS = 16
IDS = 2_000
COPIES = 3


@pytest.fixture(params=["sqlite", "postgresql", "postgresql-partitioned"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def names(db: Any) -> tuple[str, str, bool]:
    tables = db.tables
    return (tables.processed_events.fullname, tables.outbox.fullname, tables.partitioned)


@pytest.mark.slow
# SQLite runs one writer at a time, so there the two modes race alike.
@pytest.mark.parametrize(
    ("db", "claim_first"),
    [
        ("sqlite", True),
        ("postgresql", True),
        ("postgresql", False),
        ("postgresql-partitioned", True),
        ("postgresql-partitioned", False),
    ],
    ids=[
        "sqlite-claim-first",
        "postgresql-claim-first",
        "postgresql-check-first",
        "partitioned-claim-first",
        "partitioned-check-first",
    ],
    indirect=["db"],
)
def test_sixteen_workers_racing_every_id_three_times_apply_each_once(
    db: Any, claim_first: bool
) -> None:
    ledger = db.create_ledger()
    bodies = {
        f"pay-{i:05d}": json.dumps({"account": f"acct-{i % 37}", "amount": i % 101 + 1}).encode()
        for i in range(IDS)
    }
    start_at = time.time() + 4.0
    with ProcessPoolExecutor(WORKERS, mp_context=SPAWN) as pool:
        futures = [
            pool.submit(
                workers.race, db.url, names(db), ledger, bodies, COPIES, seed, start_at, claim_first
            )
            for seed in range(WORKERS)
        ]
        totals: Counter[str] = Counter()
        for future in futures:
            totals.update(future.result())

    expected = Counter()
    for body in bodies.values():
        data = json.loads(body)
        expected[data["account"]] += data["amount"]
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {ledger}").scalar() == IDS
        distinct = conn.exec_driver_sql(f"SELECT count(DISTINCT message_id) FROM {ledger}")
        assert distinct.scalar() == IDS
        sums = conn.exec_driver_sql(f"SELECT account, sum(amount) FROM {ledger} GROUP BY account")
        assert dict(sums.all()) == dict(expected)
        pe = db.tables.processed_events.fullname
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {pe}").scalar() == IDS
    assert totals["processed"] == IDS
    assert totals["duplicate"] == IDS * (COPIES * WORKERS - 1)
    assert totals["failed"] == totals["retry"] == 0


@pytest.mark.parametrize("step", ["before_handler", "in_handler", "after_insert", "after_commit"])
def test_process_killed_at_each_step_leaves_each_effect_once(db: Any, step: str) -> None:
    ledger = db.create_ledger()
    body = json.dumps({"account": "alice", "amount": 10}).encode()
    child = SPAWN.Process(target=workers.crash_at, args=(db.url, names(db), ledger, body, step))
    child.start()
    child.join(60)
    assert child.exitcode == workers.CRASH_EXIT, f"child did not die at {step}"

    # The redelivery, in a fresh consumer.
    dedup = Deduplicator(db.engine, consumer="ledger", tables=db.tables)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('alice', 10, :m)"),
            {"m": message.id},
        )

    outcome = handle(Message(id="p-1", body=body))
    committed_before = step == "after_commit"
    assert outcome is (Outcome.DUPLICATE if committed_before else Outcome.PROCESSED)
    assert handle(Message(id="p-1", body=body)) is Outcome.DUPLICATE
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {ledger}").scalar() == 1
        pe = db.tables.processed_events.fullname
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {pe}").scalar() == 1


@pytest.mark.parametrize("db", ["postgresql", "postgresql-partitioned"], indirect=True)
@pytest.mark.parametrize("claim_first", [False, True])
def test_concurrent_twins_on_postgres(db: Any, claim_first: bool) -> None:
    """Two deliveries of one id at once, both past the lookup before either commits.

    Insert-last: both handlers run, the loser's insert waits on the winner's
    key, then rolls back its work. Claim-first: the twin waits on the claim
    and never runs the handler. On a partitioned table the wait is on the
    claim's advisory lock instead of the key.
    """
    import threading

    pg = db
    ledger = pg.create_ledger()
    dedup = Deduplicator(pg.engine, consumer="ledger", tables=pg.tables)
    calls: list[str] = []
    both_inside = threading.Barrier(2, timeout=5)

    @dedup.handler(claim_first=claim_first)
    def handle(message: Message, session: Session) -> None:
        calls.append(threading.current_thread().name)
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 1, :m)"),
            {"m": message.id},
        )
        if claim_first:
            time.sleep(0.3)  # the twin arrives meanwhile and must wait on the claim
        else:
            both_inside.wait()  # proves both passed the lookup together

    message = Message(id="twin", body=b"{}")
    outcomes: list[Outcome] = []
    threads = [
        threading.Thread(target=lambda: outcomes.append(handle(message)), name=f"t{i}")
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(o.value for o in outcomes) == ["duplicate", "processed"]
    assert len(calls) == (1 if claim_first else 2)
    assert pg.scalar(f"SELECT count(*) FROM {ledger}") == 1
    assert pg.scalar(f"SELECT count(*) FROM {pg.tables.processed_events.fullname}") == 1
