"""PostgreSQL's claim statements written as SQL text: one round trip where SQLAlchemy's
constructs would need several.

``waiting_claim``: inside the request's transaction, waiting on a twin's row lock at most
the route's wait (its own lock_timeout, saved and restored in the same statements).
``trying_claim``: one statement that takes the key's advisory lock without waiting (or,
``lock=False``, none), inserts the claim and reads the record a finished request left.
``guarded_complete``: the response's UPDATE that fails when the claim is gone, for the
pipelined COMMIT (sql_pipeline.py). Used by sql_statements.KeyStatements on PostgreSQL only.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import literal_column, text
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql import Executable
from sqlalchemy.sql.elements import TextClause

from ..db.locks import SPACE_SQL

_CLAIM_COLUMNS = ("scope", "key", "fingerprint", "state", "token", "locked_until", "created_at")


def _claim_row(table: Any) -> tuple[Any, str, str, str]:
    """The quoting, the table's name, and the claim row's column list and bind names."""
    quote = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
    name = quote.format_table(table)
    listed = ", ".join(quote.quote(c) for c in _CLAIM_COLUMNS)
    values = ", ".join(f":{c}" for c in _CLAIM_COLUMNS)
    return quote, name, listed, values


_SAVED = "consumerdedup.lock_timeout"
_RESTORE = f"set_config('lock_timeout', current_setting('{_SAVED}'), true)"


def waiting_claim(
    table: Any, insert: Any, reclaim: Any
) -> tuple[Executable, Executable, Executable]:
    """PostgreSQL's claim inside the request's transaction, with its own lock_timeout and no
    extra round trip: the first INSERT saves the session's lock_timeout (in a
    transaction-local setting of ours), sets the route's wait, and restores it in RETURNING
    when it claims; a later INSERT or the reclaim UPDATE restores it when they claim. When
    nothing claims, the endpoint does not run and the transaction is rolled back."""
    quote, name, listed, values = _claim_row(table)
    first = text(
        f"WITH saved AS MATERIALIZED (SELECT set_config('{_SAVED}', "
        "current_setting('lock_timeout'), true) AS kept, "
        "set_config('lock_timeout', :b_wait, true) AS waiting) "
        f"INSERT INTO {name} ({listed}) SELECT {values} FROM saved "
        f"ON CONFLICT ({quote.quote('scope')}, {quote.quote('key')}) DO NOTHING "
        f"RETURNING {quote.quote('key')}, {_RESTORE}"
    )
    restore: Any = literal_column(_RESTORE)
    return first, insert.returning(restore), reclaim.returning(restore)


CLAIM_LOCK = "http.claim"
"""The advisory-lock class of a transactional claim (db.locks: namespaced by the table)."""


def trying_claim(table: Any, *, lock: bool = True) -> Executable:
    """PostgreSQL's claim inside the request's transaction when a twin must not be waited
    for, in one round trip: ``pg_try_advisory_xact_lock`` on the key (held to the end of the
    transaction, like the claim's row lock), the INSERT under it, and the record a finished
    request left, read in the same statement. Not lock_timeout: a 1 ms lock_timeout also
    fires on locks that are not a twin's (the table's extension lock under load), which
    answered 409 in-flight to fresh keys. A record committed after the statement's snapshot
    is not read here (``state`` NULL, nothing claimed): the caller reads it next.

    ``lock=False``: the claim committed on its own (non-transactional, PostgreSQL in
    autocommit): the unique key arbitrates, and the one statement is the whole claim when the
    key is new or its record finished (a replay), one round trip instead of BEGIN, INSERT,
    UPDATE, SELECT, COMMIT."""
    quote, name, listed, values = _claim_row(table)
    scope, key = quote.quote("scope"), quote.quote("key")
    read = ("fingerprint", "state", "locked_until", "status", "headers", "body", "expires_at")
    space = SPACE_SQL.replace(":lock_purpose", f"'{CLAIM_LOCK}'").replace(
        ":lock_table", "'" + name.replace("'", "''") + "'"
    )
    got = (
        f"pg_try_advisory_xact_lock({space}, "
        "hashtext(CAST(:scope AS text) || chr(10) || CAST(:key AS text)))"
        if lock
        else "true"
    )
    statement = text(
        f"WITH lk AS MATERIALIZED (SELECT {got} AS got), "
        f"ins AS (INSERT INTO {name} ({listed}) SELECT {values} FROM lk WHERE lk.got "
        f"ON CONFLICT ({scope}, {key}) DO NOTHING RETURNING {key}) "
        "SELECT lk.got, EXISTS (SELECT 1 FROM ins) AS claimed, "
        + ", ".join(f"r.{quote.quote(c)}" for c in read)
        + f" FROM lk LEFT JOIN {name} AS r ON r.{scope} = :scope AND r.{key} = :key"
    )
    typed = [table.c[c] for c in read]
    return statement.columns(literal_column("got"), literal_column("claimed"), *typed)


def guarded_complete(table: Any, lost: str) -> TextClause:
    """The response's UPDATE of a claim this transaction holds (its token, in flight), which
    raises (an integer cast of ``lost``, SQLSTATE 22P02) when it updates no row: sent with
    the COMMIT in one pipeline (sql_pipeline.commit_with), the error keeps that COMMIT from
    committing anything. The cast reads count(*), so it is evaluated only then."""
    quote, name, _, _ = _claim_row(table)
    c = quote.quote
    sets = ", ".join(
        [
            f"{c('state')} = :b_state",
            f"{c('status')} = :b_status",
            f"{c('headers')} = CAST(:b_headers AS json)",
            f"{c('body')} = :b_body",
            f"{c('expires_at')} = :b_expires_at",
            f"{c('token')} = NULL",
            f"{c('locked_until')} = NULL",
        ]
    )
    where = (
        f"{c('scope')} = :b_scope AND {c('key')} = :b_key AND {c('token')} = :b_token "
        f"AND {c('state')} = :b_in_flight"
    )
    return text(
        f"WITH done AS (UPDATE {name} SET {sets} WHERE {where} RETURNING 1) "
        f"SELECT CAST('{lost} (' || count(*) || ' rows)' AS integer) FROM done "
        "HAVING count(*) <> 1"
    )
