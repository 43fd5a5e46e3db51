"""Attacks on the fail-closed guard of issue 17 (items 1 to 5), through the public API.

Each test is a way found to get past the guard as it stood after that round:
a spelling of transaction control the server reads one way and our lexer
another, and what a handler can do around the statements the guard sees.
"""

from __future__ import annotations

from typing import Any

import pytest

from consumerdedup.db.control_sql import transaction_control
from tests.conftest import Database
from tests.core.test_guard_fails_closed import ends_alone

EMOJI = "\U0001f600"
LEXER_MISSES = [
    # A name ending in a character past the BMP: its $ is part of the name, no dollar quote.
    f"SELECT 1 AS a{EMOJI}$x$; COMMIT; SELECT 1 AS b{EMOJI}$x$",
    # A dollar tag with such a character: $a😀$ quotes, so the $a$ inside it is text.
    f"SELECT $a{EMOJI}$ $a$ $a{EMOJI}$; COMMIT; SELECT $a{EMOJI}$ $a$ $a{EMOJI}$",
    # A -- comment ends at a carriage return too.
    "SELECT 1; -- note\rCOMMIT",
]


@pytest.mark.parametrize("sql", [*LEXER_MISSES, "PREPARE TRANSACTION'gid'"])
def test_postgresql_reads_these_as_transaction_control(sql: str) -> None:
    assert transaction_control(sql, "postgresql") is not None


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
@pytest.mark.parametrize("spelling", LEXER_MISSES)
def test_spellings_the_lexer_read_differently_fail_their_message_alone(
    db: Database, flavor: Any, spelling: str
) -> None:
    """Before: claim-first [t1, t2, t3] ended all DUPLICATE with t3's effect never made;
    check-first kept t2's effect four times though t2 was recorded FAILED."""
    ends_alone(db, flavor, spelling)
