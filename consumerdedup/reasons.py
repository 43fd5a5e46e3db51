"""Reasons: one line saying why, safe to log, store and send to other systems.

``describe(error)`` is the one place an exception becomes text for a log line,
the error column of processed_events and outbox, and the dead-letter reason
header. It keeps a database error's own words and drops what could carry data:
SQLAlchemy's bound parameters and whatever the database quotes back.
"""

from __future__ import annotations

import re

import sqlalchemy.exc

REASON_LIMIT = 1000
"""Longest reason kept: it travels in log lines, the error column and broker headers."""

_QUOTED = re.compile(r'".*"', re.DOTALL)
"""From the first double quote to the last: a quoted value may itself hold quotes."""
_QUOTED_NAME = re.compile(r'"[^"]*"')
"""Integrity errors (SQLSTATE class 23) quote only names; their values are in DETAIL."""
_NUMBER = re.compile(r"\d{4,}")
_DIAG_NAMES = ("schema_name", "table_name", "column_name", "constraint_name")


def describe(error: BaseException) -> str:
    """``Type: text`` on one line, for logs, dead-letter headers and the error column.

    Never the statement's bound parameters, nor what a database quotes back
    (values in DETAIL lines, in quotes, long numbers): a reason is logged and
    sent to other systems. The text is storable (no NUL, no lone surrogate)
    and at most REASON_LIMIT long. It never raises.
    """
    try:
        text = _text(error)
    except Exception:  # a str() that raises must not take the pipeline with it
        text = "(its message could not be read)"
    text = " ".join(text.split())
    text = text.replace("\x00", "\\0").encode("utf-8", "backslashreplace").decode("utf-8")
    name = type(error).__name__
    line = f"{name}: {text}" if text else name
    return line if len(line) <= REASON_LIMIT else line[: REASON_LIMIT - 3] + "..."


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
    """A DB-API error's primary message with what it quotes masked; the names of the
    schema, table, column and constraint (PostgreSQL reports them apart) kept."""
    diag = getattr(error, "diag", None)
    text = getattr(diag, "message_primary", None) or str(error)
    state = getattr(error, "sqlstate", None)
    quoted = _QUOTED_NAME if (state or "").startswith("23") else _QUOTED
    text = _NUMBER.sub("...", quoted.sub('"..."', text))
    facts = [f"{n.removesuffix('_name')} {v}" for n in _DIAG_NAMES if (v := getattr(diag, n, None))]
    if state:
        facts.insert(0, f"SQLSTATE {state}")
    return f"{text} ({'; '.join(facts)})" if facts else text
