"""Every benchmark still runs: each one's smoke run (--quick) against the real services.

A benchmark that rots is a figure in the README nobody can reproduce. The smoke run is one
small round: it proves the bench works and its own checks pass (every message processed,
every event published once, every expired row pruned and no younger one), not a speed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

# What each bench must print besides its conditions: its like-with-like comparison.
EXPECTED = {
    "bench_pipeline.py": "Like with like",
    "bench_bulk.py": "Like with like",
    "bench_rabbitmq.py": "Like with like",
    "bench_kafka.py": "Like with like",
    "bench_kafka_offsets.py": "Like with like",
    "bench_relay.py": "Relay / plain",
    "bench_mysql_relay.py": "Relay / plain PyMySQL",
    "bench_mysql.py": "Like with like: consumerdedup / plain PyMySQL",
    "bench_relay_scale.py": "Relays / one relay",
    "bench_consumer_scale.py": "speed-up (ratio of medians, same run)",
    "bench_pruner.py": "Pruner / plain psycopg",
    "bench_http.py": "Through the middleware / without it",
    "bench_telemetry.py": "Telemetry / none",
    "bench_run.py": "by hand / run",
    "bench_faststream.py": "DedupMiddleware",
    "bench_celery.py": "IdempotentTask / plain",
    "bench_asyncpg.py": "asyncpg / psycopg async",
}


def test_every_bench_is_listed() -> None:
    assert sorted(p.name for p in BENCH.glob("bench_*.py")) == sorted(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECTED))
def test_the_bench_smoke_run_passes_its_own_checks(script: str) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-3000:]
    assert "Conditions" in run.stdout and "synchronous_commit=" in run.stdout, output[-3000:]
    assert "SMOKE RUN" in run.stdout, "a one-round run must say it is not a measurement"
    assert EXPECTED[script] in run.stdout, output[-3000:]


@pytest.mark.slow
def test_bench_http_with_the_raw_client_passes_its_own_checks() -> None:
    """bench_http's other client (the one that leaves the CPUs to the server) checks alike."""
    run = subprocess.run(
        [sys.executable, str(BENCH / "bench_http.py"), "--quick", "--client", "raw"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert "raw asyncio HTTP/1.1" in run.stdout and "Server CPU per request" in run.stdout
    # The peer is a dev dependency: the comparison the README quotes must run.
    assert "Redis store / asgi-idempotency-header" in run.stdout, run.stdout[-3000:]
