"""The README's quick start and docs/walkthrough.md's example run unchanged on MariaDB:
the same code, only its database URL swapped for a ``mysql+pymysql://`` one (issue 34's
"done when"). Each run gets a database of its own on the test server, dropped after.

The code run is the page's own (the quick start as pasted from the README; the
walkthrough's example file, whose blocks tests/project/test_docs.py checks are the
page's), and the output checked is the one the page shows.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.project.test_docs import EXAMPLES, ROOT, blocks, quick_start
from tests.support import mariadb_service


@pytest.fixture
def mysql_url(mariadb_url: str) -> Iterator[str]:
    """A ``mysql+pymysql://`` URL of a fresh, empty database nobody else uses."""
    with mariadb_service.isolated_database(mariadb_url) as name:
        yield mariadb_service.in_database(mariadb_url, name)


def on_mysql(code: str, sqlite_url: str, mysql_url: str) -> str:
    """``code`` with its one SQLite URL replaced: nothing else changes."""
    assert code.count(f'create_engine("{sqlite_url}")') == 1, "the example's URL moved"
    return code.replace(f'"{sqlite_url}"', f'"{mysql_url}"')


def run(code: str, folder: Path) -> str:
    script = folder / "pasted.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=folder
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_quick_start_runs_on_mariadb(mysql_url: str, tmp_path: Path) -> None:
    out = run(on_mysql(quick_start(), "sqlite://", mysql_url), tmp_path)
    assert "alice's balance: 25" in out


def test_the_walkthrough_prints_what_its_page_says_on_mariadb(
    mysql_url: str, tmp_path: Path
) -> None:
    """The page's output, line for line: 20 orders placed and shipped once despite the
    broker's redeliveries, 20 events relayed (MySQL's relay: SKIP LOCKED, key-lock rows),
    nothing pruned yet."""
    page = ROOT / "docs" / "walkthrough.md"
    shown = next(code for code in blocks(page, "") if code.startswith("deliveries:"))
    code = (EXAMPLES / "walkthrough.py").read_text()
    out = run(on_mysql(code, "sqlite:///walkthrough.db", mysql_url), tmp_path)
    assert out == shown
    assert not (tmp_path / "walkthrough.db").exists()  # it ran on MariaDB, not SQLite
