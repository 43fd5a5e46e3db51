"""``consumerdedup admin`` run for real in a subprocess: off loopback without a token it
refuses to start (exit 2, one line); served with a token, a request without it is
refused, one with it reads the pages, and an action lands in the audit log file; the
database URL's password is never printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from sqlalchemy import insert
from sqlalchemy.engine import make_url

from tests.admin.server import postgres
from tests.conftest import Database
from tests.support.kafka_service import free_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "cli-test-token-0123456789abcdef"


@pytest.fixture(scope="module")
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        rows = [
            {
                "consumer": "payments",
                "message_id": f"p-{n}",
                "processed_at": datetime.now(UTC),
                "payload_hash": "0" * 64,
                "outcome": "failed",
                "error": "KeyError: 'sku'",
            }
            for n in range(2)
        ]
        with found.engine.begin() as conn:
            conn.execute(insert(found.tables.processed_events), rows)
        yield found


def command(db: Database, *args: str) -> list[str]:
    url = make_url(db.url).set(password="pw-SECRET-42").render_as_string(hide_password=False)
    pe = db.tables.processed_events.fullname
    tables = ["--processed-events-table", pe, "--outbox-table", db.tables.outbox.fullname]
    return [sys.executable, "-m", "consumerdedup", "admin", "--db", url, *tables, *args]


def run(db: Database, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(db, *args),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        env={**os.environ, **env},
    )


def test_off_loopback_without_a_token_it_refuses_to_start(db: Database) -> None:
    done = run(db, "--host", "0.0.0.0", "--port", str(free_port()))
    assert done.returncode == 2 and done.stdout == ""
    assert "give a token" in done.stderr and len(done.stderr.splitlines()) == 1
    short = run(db, "--host", "0.0.0.0", CONSUMERDEDUP_ADMIN_TOKEN="short")
    assert short.returncode == 2 and "16 characters" in short.stderr
    alone = run(db, "--rabbitmq", "amqp://guest:guest@127.0.0.1:5672/%2F")
    assert alone.returncode == 2 and "go together" in alone.stderr
    both = run(db, "--kafka", "k:9092", "--rabbitmq", "amqp://h", "--dead-letter-topic", "a=b")
    assert both.returncode == 2 and "not allowed with" in both.stderr
    assert "pw-SECRET" not in done.stderr + short.stderr + alone.stderr


def test_served_with_a_token_it_refuses_others_and_audits_actions(
    db: Database, tmp_path: Path
) -> None:
    port, audit = free_port(), tmp_path / "audit.jsonl"
    process = subprocess.Popen(
        command(db, "--port", str(port), "--actions", "--audit-log", str(audit)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "CONSUMERDEDUP_ADMIN_TOKEN": TOKEN},
    )
    base = f"http://127.0.0.1:{port}"
    bearer = {"authorization": f"Bearer {TOKEN}"}
    try:
        with httpx.Client() as client:
            deadline = time.monotonic() + 30
            while True:
                assert process.poll() is None, process.communicate()
                try:
                    first = client.get(f"{base}/overview.json", headers=bearer)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline, "the admin server did not start"
                    time.sleep(0.05)
            assert first.status_code == 200 and first.json()["can_act"] is True
            assert "pw-SECRET" not in first.text
            assert client.get(f"{base}/overview").status_code == 401
            wrong = {"authorization": "Bearer " + "x" * len(TOKEN)}
            assert client.get(f"{base}/failures", headers=wrong).status_code == 401
            form = {"action": "forget", "scope": "matching", "consumer": "payments"}
            form |= {"csrf": first.json()["csrf"], "confirm": "yes", "why": "fixed sku"}
            form["expected"] = "2"
            done = client.post(f"{base}/failures/apply.json", data=form, headers=bearer)
            assert done.status_code == 200 and done.json()["count"] == 2
    finally:
        process.terminate()
        out, err = process.communicate(timeout=30)
    assert "pw-SECRET" not in out + err
    assert f"127.0.0.1:{port}" in out and "token required" in out
    [line] = audit.read_text().splitlines()
    entry = json.loads(line)
    assert (entry["who"], entry["action"], entry["count"]) == ("token holder", "failed.forget", 2)
    assert entry["reason"] == "fixed sku" and sorted(entry["ids"]) == ["p-0", "p-1"]
