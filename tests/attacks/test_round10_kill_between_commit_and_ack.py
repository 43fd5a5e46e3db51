"""Round 10, fresh eyes on issue 32: a worker child SIGKILLed between a batch's COMMIT and
its ack, at an exact point (the runner's before_ack hook kills its own process once).

The supervisor restarts the child; the broker delivers the unacked message again, and the
new child answers it DUPLICATE: every message applied once, nothing left in the queue,
/metrics counting the restart and the duplicate, and SIGTERM then exits 0.
"""

from __future__ import annotations

import signal
from pathlib import Path

from sqlalchemy import text

from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run, metric, wait_for

MESSAGES = 6
KILL_AT = "pay-3"


def test_a_child_killed_after_commit_before_ack_loses_and_doubles_nothing(
    pg: Database, rabbit: Broker, tmp_path: Path
) -> None:
    ledger = pg.name("ledger")
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {ledger} (message_id TEXT)"))
    queue = rabbit.queue("kill")
    for n in range(MESSAGES):
        rabbit.publish(queue, b"{}", message_id=f"pay-{n}")
    mark = tmp_path / "killed"
    run = Run(
        ["tests.attacks.round10_kill_service:app", "--health-port", "0"],
        {
            "CONSUMERDEDUP_DATABASE_URL": pg.url,
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "ROUND10_SCHEMA": str(pg.schema),
            "ROUND10_QUEUE": queue,
            "ROUND10_KILL_AT": KILL_AT,
            "ROUND10_MARK": str(mark),
        },
    )
    try:

        def applied() -> list[tuple[str, int]]:
            with pg.engine.connect() as conn:
                sql = f"SELECT message_id, count(*) FROM {ledger} GROUP BY message_id"
                return sorted((str(r[0]), int(r[1])) for r in conn.execute(text(sql)))

        wait_for(mark.exists, 60, "the child killed after its commit")
        killed = int(mark.read_text())
        wait_for(lambda: len(applied()) == MESSAGES, 120, "every message applied")
        wait_for(lambda: run.status("/readyz") == 200, 60, "ready again")
        assert killed not in run.child_pids()
        assert applied() == [(f"pay-{n}", 1) for n in range(MESSAGES)]
        _, metrics = run.get("/metrics")
        assert metric(metrics, "consumerdedup_worker_restarts_total") == 1
        assert metric(metrics, "consumerdedup_messages_total", outcome="duplicate") == 1
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr
    finally:
        run.stop()
    assert rabbit.held(queue) == 0
    assert rabbit.held(queue + ".dlq") == 0
    with pg.engine.connect() as conn:
        sql = f"SELECT outcome, count(*) FROM {pg.name('processed_events')} GROUP BY outcome"
        assert dict(conn.execute(text(sql)).all()) == {"processed": MESSAGES}
