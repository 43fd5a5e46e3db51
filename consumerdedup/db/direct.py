"""Our own fixed statements on PostgreSQL, sent straight to psycopg on a Connection's
transaction, the idea of consumerdedup.dedup.driver_sql for code that holds a Connection.

Why: SQLAlchemy's per-statement work (a cache key, an execution context, a result, a Row
per row) costs about as much CPU as the statement's own on the client. For the relay,
whose round reads 500 rows and touches each several times, a Row's attribute access
alone cost 0.6 ms a round against a named tuple's (measured: 1.6 against 1.0 ms of
Python to publish 500 rows to MemoryBroker).

A ``Direct`` is the statement compiled once by the connection's dialect (the same text
SQLAlchemy sends, casts included), its own bound constants, and a row maker. ``rows`` and
``run`` take SQLAlchemy's path instead whenever the direct one would change what anybody
sees: a connection with event listeners (before_cursor_execute hooks, tracing), a
``schema_translate_map``, a DB-API connection that is not psycopg's own (a proxy from
``creator=``), or a statement whose parameters or columns need SQLAlchemy's processing.
A driver error comes out as SQLAlchemy would raise it (``DBAPIError.instance``), and a
lost connection is invalidated as SQLAlchemy would, so retry rules and the pool see
nothing different.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Dialect
from sqlalchemy import exc as sa_exc
from sqlalchemy.sql import Executable


@dataclass(frozen=True, slots=True)
class Direct:
    """One statement as psycopg takes it, built once; ``None`` fields: SQLAlchemy's path."""

    statement: Executable
    """The SQLAlchemy statement: what runs when the direct path cannot."""
    text: str = ""
    query: bytes = b""
    constants: Mapping[str, Any] = field(default_factory=dict)
    """The statement's own bound values (lock names, literal numbers)."""
    processors: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    """SQLAlchemy's bind processing of the caller's parameters (an ARRAY's list())."""
    row: Callable[[Sequence[Any]], Any] | None = None
    """Makes a row from a tuple of values (a NamedTuple's ``_make``)."""
    usable: bool = False
    binary: bool = False
    """Rows in PostgreSQL's binary format: the same Python values, made with less work on
    both sides (no hex for a bytea, no digits for a number)."""


def compile_direct(
    statement: Executable,
    dialect: Dialect,
    given: Iterable[str],
    row: Callable[[Sequence[Any]], Any] | None = None,
    *,
    binary: bool = False,
    binary_params: Iterable[str] = (),
) -> Direct:
    """``statement`` for the direct path on ``dialect``, whose caller gives the parameters
    ``given``; one that only SQLAlchemy can run (not PostgreSQL with psycopg, expanding or
    positional parameters, columns with a result processor) is marked unusable.

    ``binary``: its rows in binary format. ``binary_params``: parameters sent in binary
    format (a list of ids: psycopg's text format first reads every number to choose the
    array's type, about three times the binary dump's work)."""
    if dialect.name != "postgresql" or dialect.driver != "psycopg":
        return Direct(statement)
    compiled: Any = statement.compile(dialect=dialect)  # type: ignore[attr-defined]
    if compiled.positiontup is not None or any(b.expanding for b in compiled.binds.values()):
        return Direct(statement)
    for column in getattr(compiled, "_result_columns", ()):
        if column[3].dialect_impl(dialect).result_processor(dialect, None) is not None:
            return Direct(statement)
    names = set(given)
    constants = {name: value for name, value in compiled.params.items() if name not in names}
    processors = {k: v for k, v in compiled._bind_processors.items() if k in names}
    if any(name in processors for name in constants):
        return Direct(statement)
    text = str(compiled)
    query = text
    for name in binary_params:
        if f"%({name})s" not in query:
            return Direct(statement)  # not a parameter of this statement: said at build time
        query = query.replace(f"%({name})s", f"%({name})b")
    return Direct(
        statement, text, query.encode(), constants, processors, row, usable=True, binary=binary
    )


def _driver(conn: Connection, direct: Direct) -> Any:
    """The psycopg connection to send ``direct`` on, or None for SQLAlchemy's path."""
    if not direct.usable or getattr(conn, "_has_events", True):
        return None
    if getattr(conn.engine, "_has_events", True):  # listeners on the engine: theirs too
        return None
    if conn.get_execution_options().get("schema_translate_map"):
        return None  # rendered per execution by SQLAlchemy: the text built once lacks it
    raw = conn.connection.driver_connection
    from psycopg import Connection as Psycopg  # an extra: imported only on this path

    return raw if type(raw) is Psycopg else None


def rows(conn: Connection, direct: Direct, params: Mapping[str, Any]) -> list[Any]:
    """The statement's rows (made by ``direct.row``, else SQLAlchemy Rows)."""
    raw = _driver(conn, direct)
    if raw is None:
        return list(conn.execute(direct.statement, dict(params)).all())
    cursor = _cursor(raw)
    values = _params(direct, params)
    try:
        cursor.execute(direct.query, values, binary=direct.binary)
        found = cursor.fetchall()
    except conn.dialect.loaded_dbapi.Error as exc:
        raise translated(conn, direct.text, values, exc, cursor) from exc
    finally:
        cursor.close()
    make = direct.row
    return found if make is None else [make(values) for values in found]


def run(conn: Connection, direct: Direct, params: Mapping[str, Any]) -> None:
    """Run a statement that returns no rows (an UPDATE, a DELETE)."""
    raw = _driver(conn, direct)
    if raw is None:
        conn.execute(direct.statement, dict(params))
        return
    cursor = _cursor(raw)
    values = _params(direct, params)
    try:
        cursor.execute(direct.query, values)
    except conn.dialect.loaded_dbapi.Error as exc:
        raise translated(conn, direct.text, values, exc, cursor) from exc
    finally:
        cursor.close()


def _params(direct: Direct, params: Mapping[str, Any]) -> dict[str, Any]:
    values = {**direct.constants, **params}
    for name, process in direct.processors.items():
        if name in values:
            values[name] = process(values[name])
    return values


def tuple_rows() -> Any:
    """psycopg's plain tuples, whatever row_factory the application set. (psycopg is
    imported here, not above: it is an extra, and SQLite never comes this way.)"""
    from psycopg.rows import tuple_row

    return tuple_row


def _cursor(raw: Any) -> Any:
    return raw.cursor(row_factory=tuple_rows())


def translated(
    connection: Connection, text: str, params: Any, error: Exception, cursor: Any
) -> sa_exc.StatementError:
    """``error`` as SQLAlchemy raises a driver error; a lost connection is invalidated."""
    dialect = connection.dialect
    lost = connection.invalidated or dialect.is_disconnect(
        error,  # type: ignore[arg-type]
        connection.connection.dbapi_connection,
        cursor,
    )
    if lost and not connection.invalidated:
        connection.invalidate(error)
    return sa_exc.DBAPIError.instance(
        text,
        params,
        error,
        dialect.loaded_dbapi.Error,
        hide_parameters=connection.engine.hide_parameters,
        connection_invalidated=lost,
        dialect=dialect,
    )
