"""examples/rabbitmq_consumer.py runs as shipped, against the real broker and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "rabbitmq_consumer.py"


def test_the_rabbitmq_example_consumes_into_postgresql(rabbit: Broker, postgres_url: str) -> None:
    queue = rabbit.name("example")  # deleted with its .dlq afterwards
    env = {**os.environ, "CONSUMERDEDUP_AMQP_URL": rabbit.url, "CONSUMERDEDUP_DB_URL": postgres_url}
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), queue],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=EXAMPLE.parent.parent,
    )
    assert done.returncode == 0, done.stderr
    assert "orders: 100" in done.stdout
