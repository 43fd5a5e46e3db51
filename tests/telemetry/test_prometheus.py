"""The gauges in the Prometheus text format: ``stats --format prometheus`` parsed by
prometheus_client's own parser; ``/metrics`` of a real running relay over HTTP."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from consumerdedup.schema import DEFAULT
from consumerdedup.telemetry.prometheus import exposition
from consumerdedup.telemetry.readings import Readings
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401
from tests.telemetry.conftest import seeded

ROOT = Path(__file__).resolve().parents[2]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_the_gauges_parse_with_prometheus_clients_own_parser(tmp_path: Path) -> None:
    engine = seeded(tmp_path)
    text = exposition(Readings.take(engine, DEFAULT), DEFAULT)
    got = samples(text)
    pe, ob = (("table", "processed_events"),), (("table", "outbox"),)
    assert got[("consumerdedup_processed_events_rows", (("consumer", "ledger"), *pe))] == 3
    assert got[("consumerdedup_processed_events_rows", (("consumer", "audit"), *pe))] == 1
    assert got[("consumerdedup_failed_records", (("consumer", "ledger"), *pe))] == 1
    assert got[("consumerdedup_outbox_backlog_events", ob)] == 3
    assert got[("consumerdedup_outbox_parked_events", ob)] == 0
    assert 0 <= got[("consumerdedup_outbox_oldest_unpublished_age_seconds", ob)] < 60
    assert not any("m0" in str(labels) for _, labels in got)  # no message ids in labels


def test_stats_format_prometheus_prints_them(tmp_path: Path) -> None:
    seeded(tmp_path)
    db = f"sqlite:///{tmp_path / 'x.db'}"
    done = subprocess.run(
        [sys.executable, "-m", "consumerdedup", "stats", "--db", db, "--format", "prometheus"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    got = samples(done.stdout)
    assert got[("consumerdedup_outbox_backlog_events", (("table", "outbox"),))] == 3


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def scrape(port: int, deadline: float) -> str:
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                text: str = resp.read().decode()
                return text
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_running_relay_serves_metrics_and_says_its_status(tmp_path: Path, amqp_url: str) -> None:
    """One relay process: /metrics over HTTP, a status line, a stop line, all stamped."""
    engine = seeded(tmp_path)
    port = free_port()
    db = f"sqlite:///{tmp_path / 'x.db'}"
    relay = subprocess.Popen(
        [
            sys.executable, "-m", "consumerdedup", "relay", "--db", db, "--rabbitmq", amqp_url,
            "--metrics-port", str(port), "--status-every", "200ms", "--max-attempts", "1",
            "--poll", "100ms",
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(relay.stdout or []), daemon=True)
    reader.start()
    table = (("table", "outbox"),)
    try:
        deadline = time.monotonic() + 20
        while True:  # the three events go nowhere (no queue): parked after one attempt
            got = samples(scrape(port, deadline))
            if got.get(("consumerdedup_outbox_parked_events", table)) == 3:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.05)
        assert got[("consumerdedup_outbox_backlog_events", table)] == 0
        assert got[("consumerdedup_database_up", ())] == 1
        assert got[("consumerdedup_relay_published_events_total", ())] == 0
        failed = (("consumer", "ledger"), ("table", "processed_events"))
        assert got[("consumerdedup_failed_records", failed)] == 1
        while not any("relay: published 0 since start, 0 waiting" in line for line in lines):
            assert time.monotonic() < deadline, lines
            time.sleep(0.05)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(20) == 0, relay.stderr.read() if relay.stderr else ""
        reader.join(5)
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.wait()
    assert "relay stopped: published 0 since start, 0 waiting (oldest -), 3 parked" in lines[-1]
    stamp = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ")  # a long run's every line
    assert all(stamp.match(line) for line in lines), lines
    engine.dispose()
