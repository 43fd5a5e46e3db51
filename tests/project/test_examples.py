"""The examples (and so the README's snippets, which come from them) run as shipped."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(name: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        cwd=EXAMPLES.parent,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_quickstart() -> None:
    assert "alice's balance: 25" in run("quickstart.py")


def test_app_quickstart() -> None:
    """The README's App, run on SQLite and the in-memory broker: a payment delivered twice
    is credited once, a body without its amount is dead-lettered with the field at fault."""
    out = run("app_quickstart.py")
    assert "alice's balance: 25" in out
    assert "dead-lettered: pay-2 (InvalidBody: body does not validate as Payment: amount" in out


def test_memory_consumer() -> None:
    """The orders table has no unique key, so an order applied twice would be counted twice
    (not refused and dead-lettered); the example asserts the same before it prints."""
    out = run("memory_consumer.py")
    assert "crashed between commit and ack" in out
    assert "orders: 100 (100 distinct), dead letters: 0" in out, out
    found = re.search(
        r"deliveries: (\d+), .*processed=(\d+), duplicate=(\d+), failed=0, retry=0", out
    )
    assert found, out
    deliveries, processed, duplicate = map(int, found.groups())
    # The crashed consumer's batch of 10, committed but never acked, comes back whole: 10
    # duplicates by construction; the broker's seeded lost acks (seed=1) add the rest.
    assert processed == 100 and duplicate >= 10, out
    assert deliveries == processed + duplicate, out


def test_async_postgres(postgres_url: str) -> None:
    assert "shipments: 50" in run("async_postgres.py", CONSUMERDEDUP_DB_URL=postgres_url)


def test_http_payments(postgres_url: str) -> None:
    """13 calls with one key (a retry, ten at once, another body) charge once; the relay
    publishes each payment's event; the consumer applies each once despite duplicates."""
    out = run("http_payments.py", CONSUMERDEDUP_DB_URL=postgres_url)
    assert "13 requests, 10 replayed: payments 2" in out, out
    assert "events published: 2" in out and "balances: alice 25, bob 40" in out, out


def test_bulk_consumer() -> None:
    """One bulk call per batch, duplicates left out, the order it names failing alone."""
    out = run("bulk_consumer.py")
    assert "orders: 199 (199 distinct), dead letters: 1" in out, out
    assert "processed=199" in out and "failed=1" in out, out
