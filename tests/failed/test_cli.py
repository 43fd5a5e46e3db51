"""``consumerdedup failed list|show|forget`` and ``consumerdedup forget``, through the CLI's
``main()`` in process (the replay tests run it in a subprocess)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from tests.conftest import Database, database
from tests.failed.test_records import add
from tests.support.cli import Cli, cli_fixture  # noqa: F401


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    yield from database(request, request.param, tmp_path)


def left(db: Database) -> list[tuple[str, str]]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return sorted(conn.execute(select(pe.c.message_id, pe.c.outcome)).all())


def test_list_pages_show_and_forget(db: Database, cli: Cli) -> None:
    add(db, "billing", ["b1", "b2", "b3"], error="KeyError: 'sku'")
    add(db, "billing", ["done"], outcome="processed")
    first = cli(db, "failed", "list", "--limit", "2")
    assert first.returncode == 0, first.stderr
    lines = first.stdout.splitlines()
    assert lines[0].split() == ["CONSUMER", "MESSAGE", "ID", "FAILED", "AT", "REASON"]
    assert [line.split()[1] for line in lines[1:3]] == ["b1", "b2"]
    cursor = lines[-1].removeprefix("next page: --after ")
    second = json.loads(cli(db, "failed", "list", "--json", "--after", cursor).stdout)
    assert [r["message_id"] for r in second["records"]] == ["b3"]
    assert second["next_cursor"] is None
    shown = json.loads(cli(db, "failed", "show", "--consumer", "billing", "b2", "--json").stdout)
    assert shown["reason"] == "KeyError: 'sku'"
    missing = cli(db, "failed", "show", "--consumer", "billing", "done")
    assert missing.returncode == 1 and "no FAILED record" in missing.stderr
    bad = cli(db, "failed", "list", "--after", "nonsense")
    assert bad.returncode == 2 and "cursor" in bad.stderr
    assert cli(db, "failed", "list", "--limit", "1001").returncode == 2

    dry = cli(db, "forget", "--consumer", "billing", "b1", "done", "--dry-run")
    assert "would forget 1 FAILED record(s) of 'billing': b1" in dry.stdout, dry.stdout
    assert "1 id(s) without a FAILED record (none, or completed), left alone: done" in dry.stdout
    refused = cli(db, "forget", "--consumer", "billing", "b1", stdin="n\n")
    assert refused.returncode == 1 and "not confirmed" in refused.stderr
    assert len(left(db)) == 4
    done = cli(db, "forget", "--consumer", "billing", "b1", "done", stdin="y\n")
    assert "forgot 1 FAILED record(s) of 'billing': b1" in done.stdout, done.stdout
    assert left(db) == [("b2", "failed"), ("b3", "failed"), ("done", "processed")]
    by_reason = cli(
        db, "failed", "forget", "--consumer", "billing", "--reason", "keyerror", "--yes"
    )
    assert "forgot 2 FAILED record(s) of 'billing': b2, b3" in by_reason.stdout
    assert left(db) == [("done", "processed")]
