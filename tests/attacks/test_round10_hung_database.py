"""Round 10, fresh eyes on issue 32 through `consumerdedup run`: a database that accepts the
connection and never answers (a hung server, a black-holed route), at start.

Seen failing before the fix: libpq waits for ever by default, so the part's start checks
hung in connect. /readyz said 503 with no reason (error: null), the promised "checked again
with backoff" never came, and SIGTERM waited the whole --shutdown-timeout, then exited 1
("parts still running at the shutdown timeout") though nothing had been consumed. The App's
engines now bound the connect (CONNECT_TIMEOUT, unless the URL sets connect_timeout): the
hang becomes the outage the runner already waits out, said on /readyz, and a stop is clean.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator

import pytest

from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.support.run_command import Run, wait_for

APP = "tests.worker.ledger_service:app"


@pytest.fixture
def hung_database() -> Iterator[int]:
    """A port whose listener takes connections (the kernel's backlog) and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield listener.getsockname()[1]
    listener.close()


def test_a_database_that_never_answers_is_said_on_readyz_and_a_stop_is_clean(
    hung_database: int, rabbit: Broker
) -> None:
    run = Run(
        [APP, "--health-port", "0"],
        {
            "CONSUMERDEDUP_DATABASE_URL": f"postgresql://app@127.0.0.1:{hung_database}/svc",
            "CONSUMERDEDUP_RABBITMQ_URL": rabbit.url,
            "LEDGER_QUEUE": rabbit.queue("ledger"),
            "LEDGER_SCHEMA": "ledger_round10",
        },
    )
    try:

        def said() -> str | None:
            _, body = run.get("/readyz")
            part = (body["workers"][0].get("parts") or {}).get("ledger") or {}
            return part.get("error")

        error = wait_for(said, 60, "/readyz saying why the part is not ready")
        assert "timeout" in error
        assert run.status("/readyz") == 503
        run.signal(signal.SIGTERM)
        assert run.wait(60) == 0, run.stderr
        assert "still running at the shutdown timeout" not in run.stderr
    finally:
        run.stop()
