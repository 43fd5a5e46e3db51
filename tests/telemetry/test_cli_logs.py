"""The CLI's log lines: broker clients one line each, SQL echo by its own flag."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine

from consumerdedup import install
from consumerdedup.cli.main import BrokerClientLines

ROOT = Path(__file__).resolve().parents[2]


def record(name: str, msg: str) -> logging.LogRecord:
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except ConnectionRefusedError:
        exc_info = sys.exc_info()
    return logging.LogRecord(name, logging.ERROR, __file__, 1, msg, (), exc_info)


def test_a_broker_client_line_goes_without_its_traceback_and_once() -> None:
    lines = BrokerClientLines()
    first = record("pika.adapters.utils.connection_workflow", "connection attempt failed")
    assert lines.filter(first) and first.exc_info is None
    again = record("pika.adapters.utils.connection_workflow", "connection attempt failed")
    assert not lines.filter(again)  # the reconnect loop says it again: collapsed
    other = record("aiokafka.conn", "unable to connect")
    assert lines.filter(other) and other.exc_info is None
    ours = record("consumerdedup.relay", "relay round failed")
    assert lines.filter(ours) and ours.exc_info is not None  # ours are left alone


def stats(tmp_path: Path, *flags: str) -> str:
    db = f"sqlite:///{tmp_path / 'x.db'}"
    install(create_engine(db))
    done = subprocess.run(
        [sys.executable, "-m", "consumerdedup", "stats", "--db", db, *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_sql_echo_has_its_own_flag(tmp_path: Path) -> None:
    assert "SELECT" not in stats(tmp_path, "--verbose")  # DEBUG, without every statement
    assert "SELECT" in stats(tmp_path, "--echo-sql")
