"""The CLI's log lines: broker clients one line each, SQL echo by its own flag."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_long_one_shot_work_shows_progress_on_a_terminal_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    import time

    from consumerdedup.cli import status

    monkeypatch.setattr(status, "PROGRESS_EVERY", 0.02)
    args = argparse.Namespace(timestamps=False)
    with status.on_a_terminal(args, lambda: "... 5 published so far"):
        time.sleep(0.1)  # the work; not a wait for the lines
    assert capsys.readouterr().out == ""  # a pipe: no progress lines
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    deadline = time.monotonic() + 5
    with status.on_a_terminal(args, lambda: "... 5 published so far"):
        while "published so far" not in (seen := capsys.readouterr().out):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    assert seen.splitlines()[0] == "... 5 published so far"
