"""Reasons: one line saying why, safe to log, store and send to other systems.

``describe(error)`` is the one place an exception becomes text for a log line,
the error column of processed_events and outbox, and the dead-letter reason
header. It keeps what the user needs to fix the problem and drops what could
carry data:

* kept: the names of databases, roles, schemas, relations, columns,
  constraints and types, the host and the port, where the database's message
  is one we know (``relation "ledger.accounts" does not exist``);
* masked: SQLAlchemy's bound parameters, the DETAIL/CONTEXT lines (they quote
  rows and keys), the values a database quotes back (``invalid input syntax for
  type integer: "..."``), everything quoted and every long number in a message
  we do not know, and passwords in URLs and ``password=`` pairs anywhere.

A setup fault (a missing table, database or role, a refused connection, a
password refused) ends with what to do about it. The parts: ``masking`` (values and
passwords), ``connection`` (libpq's account of a failed connection), ``fixes`` (what
to do about a setup fault); this module turns an exception into its one line.
"""

from __future__ import annotations

import re

import sqlalchemy.exc

from .connection import connection_text, is_connection_failure
from .fixes import statement_fix
from .masking import CARDLIKE, MASK, mask_passwords, masked

__all__ = ["MASK", "REASON_LIMIT", "authentication_refused", "describe", "mask_passwords", "masked"]

REASON_LIMIT = 1000
"""Longest reason kept: it travels in log lines, the error column and broker headers."""

_TRAILERS = re.compile(r"\n(?:DETAIL|HINT|CONTEXT|QUERY|LINE \d+|WHERE|STATEMENT):.*", re.DOTALL)
"""What psycopg appends after the primary message: rows, keys and the statement's text."""
_DIAG_NAMES = ("schema_name", "table_name", "column_name", "constraint_name")


def describe(error: BaseException) -> str:
    """``Type: text`` on one line, for logs, dead-letter headers and the error column.

    Never the statement's bound parameters, nor a value a database quotes back,
    nor a password; the names of what is missing or refused, and the fix for a
    setup fault. The text is storable (no NUL, no lone surrogate) and at most
    REASON_LIMIT long. It never raises.
    """
    try:
        text = _text(error)
    except Exception:  # a str() that raises must not take the pipeline with it
        text = "(its message could not be read)"
    text = " ".join(mask_passwords(text).split())
    text = text.replace("\x00", "\\0").encode("utf-8", "backslashreplace").decode("utf-8")
    name = type(error).__name__
    line = f"{name}: {text}" if text else name
    return line if len(line) <= REASON_LIMIT else line[: REASON_LIMIT - 3] + "..."


_REFUSED_LOGIN = re.compile(
    r'password authentication failed for user "|role "[^"]*" does not exist'
    r'|role "[^"]*" is not permitted to log in'
)
"""libpq's words at connect for SQLSTATE class 28 (psycopg gives no SQLSTATE there)."""


def authentication_refused(error: BaseException) -> bool:
    """The database refused the login: SQLSTATE class 28 (invalid authorization: a wrong
    password, a role that does not exist or may not log in), by code or by libpq's words."""
    orig = getattr(error, "orig", None) or error
    if (getattr(orig, "sqlstate", None) or "").startswith("28"):
        return True
    return bool(_REFUSED_LOGIN.search(str(orig)))


def _text(error: BaseException) -> str:
    # SQLAlchemy's str() appends "[SQL: ...] [parameters: ...]": the driver's own error only.
    if isinstance(error, sqlalchemy.exc.StatementError):
        if error.orig is not None:
            return _driver_text(error.orig)
        return str(error.args[0]) if error.args else ""
    if _is_driver_error(error):
        return _driver_text(error)
    return str(error)


def _is_driver_error(error: BaseException) -> bool:
    return hasattr(error, "sqlstate") or hasattr(error, "sqlite_errorname")


def _driver_text(error: BaseException) -> str:
    """A DB-API error's primary message, its names kept and its values masked, then the
    names PostgreSQL reports apart (schema, table, column, constraint) not already said."""
    diag = getattr(error, "diag", None)
    raw = getattr(diag, "message_primary", None) or _TRAILERS.sub("", str(error))
    state = getattr(error, "sqlstate", None)
    if is_connection_failure(raw):
        return connection_text(raw)
    text = masked(raw)
    if fix := statement_fix(state, getattr(error, "sqlite_errorname", None), text):
        text = f"{text}: {fix}"
    facts = [
        f"{n.removesuffix('_name')} {v}"
        for n in _DIAG_NAMES
        if (v := getattr(diag, n, None)) and f'"{v}"' not in text
    ]
    if state:
        facts.insert(0, f"SQLSTATE {state}")
    return CARDLIKE.sub(MASK, f"{text} ({'; '.join(facts)})" if facts else text)
