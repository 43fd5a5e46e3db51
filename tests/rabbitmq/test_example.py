"""examples/rabbitmq_consumer.py runs as shipped, against the real broker and PostgreSQL."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rabbitmq_consumer.py"


def test_the_rabbitmq_example_consumes_into_postgresql(rabbit: Broker, postgres_url: str) -> None:
    """Each order placed once, counted in a table without a unique key (a second insert would
    show, not fail into a dead letter); nothing dead-lettered; a schema of this run's own."""
    queue = rabbit.name("example")  # deleted with its .dlq afterwards
    schema = f"example_rabbitmq_{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "CONSUMERDEDUP_AMQP_URL": rabbit.url,
        "CONSUMERDEDUP_DB_URL": postgres_url,
        "EXAMPLE_SCHEMA": schema,
    }
    engine = create_engine(postgres_url)
    try:
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), queue],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            cwd=EXAMPLE.parent.parent,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        expected = (
            "processed 100, duplicates 20, dead-lettered 0, retried 0; orders: 100 (100 distinct)"
        )
        assert expected in done.stdout, done.stdout
        with engine.connect() as conn:
            orders = f"SELECT count(*), count(DISTINCT id), sum(total) FROM {schema}.orders"
            assert tuple(conn.execute(text(orders)).one()) == (100, 100, sum(range(100)) * 10)
            recorded = f"SELECT outcome, count(*) FROM {schema}.processed_events GROUP BY 1"
            assert dict(conn.execute(text(recorded)).all()) == {"processed": 100}
        assert rabbit.ready(queue + ".dlq") == 0
        assert rabbit.held(queue) == 0
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()
