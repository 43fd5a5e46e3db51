"""Round 9, fresh eyes on issue 38 item 6 (the circuit breaker) through `consumerdedup run`.

A broken deploy under the worker: the breaker opens after ``breaker_threshold`` FAILED,
the runner's run() ends with CircuitOpen, and the process must then stop taking messages.
Seen failing before the fix: the worker took CircuitOpen for a crash, the supervisor
restarted the child, whose new runner had a closed breaker; each restart dead-lettered
``breaker_threshold`` more messages, so the whole stream ended in the dead-letter queue
anyway (the very thing the breaker is for), with a traceback per restart.
"""

from __future__ import annotations

import time
import uuid

from sqlalchemy import text

from tests.conftest import Database
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run

THRESHOLD = 2
MESSAGES = 12


def _failed(pg: Database, consumer: str) -> int:
    with pg.engine.connect() as conn:
        sql = f"SELECT count(*) FROM {pg.name('processed_events')} WHERE consumer = :c"
        return int(conn.execute(text(sql), {"c": consumer}).scalar_one())


def test_a_broken_deploy_under_the_worker_dead_letters_threshold_messages_not_the_stream(
    pg: Database, rabbit: Broker
) -> None:
    queue = rabbit.queue("breaker")
    consumer = f"payments-{uuid.uuid4().hex[:8]}"
    for n in range(MESSAGES):
        rabbit.publish(queue, b'{"amount": 100}', message_id=f"pay-{n}")
    run = Run(
        ["tests.attacks.round9_breaker_service:app"],
        {
            "CONSUMERDEDUP_DATABASE_URL": pg.url,
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "BREAKER_SCHEMA": str(pg.schema),
            "BREAKER_QUEUE": queue,
            "BREAKER_CONSUMER": consumer,
            "BREAKER_THRESHOLD": str(THRESHOLD),
        },
    )
    try:
        # Until it stops by itself, or a restart took more than the breaker allows.
        deadline = time.monotonic() + 90
        while run.process.poll() is None and _failed(pg, consumer) <= THRESHOLD:
            assert time.monotonic() < deadline, f"neither stopped nor went on:\n{run.stderr}"
            time.sleep(0.05)
        code = run.wait(60)
        recorded = _failed(pg, consumer)
        assert recorded == THRESHOLD, run.stderr  # not one more dead-lettered after it opened
        assert code == 1, run.stderr
        last = run.stderr.strip().splitlines()[-1]
        assert "circuit breaker" in last and "KeyError" in last, run.stderr
        # The handler's traceback once per distinct error (issue 38 item 6); the stop itself
        # is expected, said in lines without one.
        assert run.stderr.count("Traceback") == 1, run.stderr
        assert "raise_if_open" not in run.stderr
        assert rabbit.held(queue) == MESSAGES - THRESHOLD  # the rest stay with the broker
        assert rabbit.held(queue + ".dlq") == THRESHOLD
    finally:
        run.stop()
