"""Round 11 attacks on the operator CLI over MariaDB: ids and reasons the server could
compare loosely, or read as patterns.

``failed forget`` deletes records so redeliveries run again: forgetting one that was not
named would let its message's effects apply twice. Ids differing in case, a trailing
space, or a Unicode folding are distinct messages on MySQL (binary NO PAD keys), so they
must be distinct to the CLI too; a ``--reason`` holding LIKE's wildcards (``_``, ``%``)
or a backslash (MySQL's default LIKE escape) matches itself only.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from tests.conftest import Database
from tests.failed.test_records import add
from tests.support.cli import Cli, cli_fixture  # noqa: F401

LOOKALIKES = ["key", "KEY", "key ", "kéy", "ke\u0301y", "\U0001f600key"]


def left(db: Database) -> list[str]:
    pe = db.tables.processed_events
    with db.engine.connect() as conn:
        return sorted(r[0] for r in conn.execute(select(pe.c.message_id)))


@pytest.mark.parametrize("target", LOOKALIKES)
def test_forget_by_id_forgets_that_id_alone(mariadb: Database, cli: Cli, target: str) -> None:
    add(mariadb, "c", LOOKALIKES)
    done = cli(mariadb, "forget", "--consumer", "c", target, "--yes")
    assert done.returncode == 0, done.stderr
    assert left(mariadb) == sorted(i for i in LOOKALIKES if i != target)
    shown = cli(mariadb, "failed", "show", "--consumer", "c", LOOKALIKES[0], "--json")
    if target != LOOKALIKES[0]:
        assert json.loads(shown.stdout)["message_id"] == LOOKALIKES[0]


def test_failed_show_tells_lookalikes_apart(mariadb: Database, cli: Cli) -> None:
    add(mariadb, "c", LOOKALIKES)
    for message_id in LOOKALIKES:
        shown = cli(mariadb, "failed", "show", "--consumer", "c", message_id, "--json")
        assert shown.returncode == 0, shown.stderr
        assert json.loads(shown.stdout)["message_id"] == message_id
    listed = json.loads(cli(mariadb, "failed", "list", "--json", "--limit", "1000").stdout)
    assert sorted(r["message_id"] for r in listed["records"]) == sorted(LOOKALIKES)


REASONS = {
    "a_b": "ValueError: a_b",
    "axb": "ValueError: axb",
    "pct": "ValueError: 100%",
    "pcx": "ValueError: 100x",
    "bsl": "ValueError: C:\\temp",
    "bsx": "ValueError: C:temp",
}


@pytest.mark.parametrize(
    ("reason", "expected"),
    [("a_b", ["a_b"]), ("100%", ["pct"]), ("C:\\temp", ["bsl"]), ("c:\\TEMP", ["bsl"])],
)
def test_forget_by_reason_reads_wildcards_literally(
    mariadb: Database, cli: Cli, reason: str, expected: list[str]
) -> None:
    for message_id, error in REASONS.items():
        add(mariadb, "c", [message_id], error=error)
    done = cli(mariadb, "failed", "forget", "--consumer", "c", "--reason", reason, "--yes")
    assert done.returncode == 0, done.stderr
    assert left(mariadb) == sorted(set(REASONS) - set(expected))
