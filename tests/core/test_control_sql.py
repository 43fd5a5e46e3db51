"""db.control_sql: transaction control found the way the server's lexer finds it.

The integration tests (test_guard_fails_closed) send these spellings to the
real servers; this table pins the readings, including the ambiguous ones.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

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


LITERALS = [
    "'a'", "'\\'", "'\\''", "E'\\''", "E'\\\\'", "$$x$$", "$a$ ; $a$", "U&'\\0041'", "''''",
    "'--'", "'/*'", "$$'$$",
]  # fmt: skip
COMMENTS = ["", "/* */", "/* /* */ */", "-- x\n", "/* ' */", "-- '\n"]
NAMES = ["", " AS a$b$", ' AS "q;"', " AS x", " AS e"]
CONTROLS = ["COMMIT", "commit work", "END", "ABORT", "ROLLBACK", "COMMIT AND CHAIN"]


def random_text(rng: random.Random) -> str:
    """Valid statements of literals, comments and names the lexers may read differently, then
    a control statement, then more: most of them end the transaction on the real server."""

    def statement() -> str:
        literals = " || ".join(rng.choice(LITERALS) for _ in range(rng.randint(1, 3)))
        return f"SELECT {literals}{rng.choice(COMMENTS)}{rng.choice(NAMES)}"

    parts = [statement() for _ in range(rng.randint(1, 2))]
    parts.append(rng.choice(COMMENTS) + rng.choice(CONTROLS))
    return "; ".join(parts) + rng.choice(["", "; " + statement(), " " + rng.choice(LITERALS)])


def test_no_random_text_that_ends_a_postgresql_transaction_gets_past(pg: Any) -> None:
    """Differential, against the real server: 200 seeded texts, each run inside a transaction
    with standard_conforming_strings on and off. Every one that ended the transaction (or
    chained a new one) must have been found."""
    rng = random.Random(17)
    raw = pg.engine.raw_connection()
    conn = raw.driver_connection
    missed, ended_count = [], 0
    try:
        for _ in range(200):
            sql = random_text(rng)
            for conforming in ("on", "off"):
                conn.rollback()
                conn.execute(f"SET standard_conforming_strings = {conforming}")
                conn.commit()
                xid = conn.execute("SELECT txid_current()").fetchone()[0]
                with contextlib.suppress(Exception):
                    conn.execute(sql)
                status = conn.info.transaction_status
                ended = status == 0 or (  # IDLE, or a new transaction (AND CHAIN)
                    status == 2 and conn.execute("SELECT txid_current()").fetchone()[0] != xid
                )
                ended_count += ended
                if ended and transaction_control(sql, "postgresql") is None:
                    missed.append((conforming, sql))
    finally:
        conn.rollback()
        conn.execute("SET standard_conforming_strings = on")
        conn.commit()
        raw.close()
    assert ended_count > 100, "the generator must exercise the server, not only syntax errors"
    assert missed == []
