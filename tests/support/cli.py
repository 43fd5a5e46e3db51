"""``consumerdedup`` run in process through ``main()`` on a test's database: the exit code
and what it wrote, with stdin as given (the subprocess tests run ``python -m consumerdedup``).

A module using the ``cli`` fixture imports ``cli_fixture`` (pytest finds it by name).
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from consumerdedup.cli.main import main
from tests.conftest import Database


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


Cli = Callable[..., Run]
"""``cli(db, *args, stdin="")``: ``consumerdedup ARGS`` on ``db``'s database and tables."""


def database_options(db: Database) -> list[str]:
    """``--db`` and the table names of ``db``, for any command."""
    tables = ["--processed-events-table", db.tables.processed_events.fullname]
    return ["--db", db.url, *tables, "--outbox-table", db.tables.outbox.fullname]


@pytest.fixture(name="cli")
def cli_fixture(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Cli:
    def run(db: Database, *args: str, stdin: str = "") -> Run:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
        try:
            code = main([*args, *database_options(db)])
        except SystemExit as exited:  # argparse's usage errors
            code = int(exited.code or 0)
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run
