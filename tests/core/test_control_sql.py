"""db.control_sql: transaction control found the way the server's lexer finds it.

The integration tests (test_guard_fails_closed) send these spellings to the
real servers; this table pins the readings, including the ambiguous ones.
"""

from __future__ import annotations

import pytest

from consumerdedup.db.control_sql import transaction_control

POSTGRESQL = {
    "/* x */ COMMIT": "COMMIT",
    "-- x\nCOMMIT": "COMMIT",
    "SELECT 1; COMMIT": "COMMIT",
    "/* a /* b */ c */ COMMIT": "COMMIT",
    "commit work": "COMMIT",
    "COMMIT AND CHAIN": "COMMIT",
    ";COMMIT": "COMMIT",
    "END": "END",
    "abort": "ABORT",
    "ROLLBACK AND CHAIN": "ROLLBACK",
    "ROLLBACK WORK": "ROLLBACK",
    "START TRANSACTION": "START TRANSACTION",
    "BEGIN": "BEGIN",
    "PREPARE TRANSACTION 'x'": "PREPARE TRANSACTION",
    "COMMIT PREPARED 'x'": "COMMIT PREPARED",
    "SELECT 'a\\'' ; COMMIT --'": "COMMIT",  # standard_conforming_strings off: a', then COMMIT
    "SELECT type'x'; COMMIT": "COMMIT",  # not an E'' string: the quote ends at the next one
    "SELECT 1 AS a$b$ ; COMMIT --$b$": "COMMIT",  # a$b$ is a name: no dollar quote starts
    "ROLLBACK TO SAVEPOINT a": None,
    "rollback transaction to a": None,
    "SAVEPOINT a": None,
    "RELEASE SAVEPOINT a": None,
    'SELECT 1 AS "commit"': None,
    '"commit"': None,
    "SELECT 'x; COMMIT'": None,
    "SELECT 1 -- ; COMMIT": None,
    "SELECT $$; COMMIT$$": None,
    "SELECT $a$ ; COMMIT $a$": None,
    "SELECT E'\\'; COMMIT; --'": None,  # E'' escapes the quote: one string to the end
    "/* a /* b */ COMMIT": None,  # still inside the outer comment (unterminated)
    "INSERT INTO t (end_at) VALUES (1)": None,
    "SELECT CASE WHEN 1 THEN 2 END": None,
    "PREPARE q AS SELECT 1": None,
}
SQLITE = {
    "/* a /* b */ COMMIT": "COMMIT",  # SQLite's comments do not nest
    "end transaction": "END",
    "[x; COMMIT]": None,
    "SELECT `a;COMMIT`": None,
    "INSERT OR ROLLBACK INTO t VALUES (1)": None,
}


@pytest.mark.parametrize(("sql", "expected"), POSTGRESQL.items(), ids=repr)
def test_postgresql_readings(sql: str, expected: str | None) -> None:
    assert transaction_control(sql, "postgresql") == expected


@pytest.mark.parametrize(("sql", "expected"), SQLITE.items(), ids=repr)
def test_sqlite_readings(sql: str, expected: str | None) -> None:
    assert transaction_control(sql, "sqlite") == expected


def test_an_unknown_dialect_is_read_every_way() -> None:
    assert transaction_control("/* a /* b */ COMMIT", "other") == "COMMIT"
