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
password refused) ends with what to do about it (``fix``).
"""

from __future__ import annotations

import re

import sqlalchemy.exc

REASON_LIMIT = 1000
"""Longest reason kept: it travels in log lines, the error column and broker headers."""

MASK = "..."

_QUOTED = re.compile(r'".*"', re.DOTALL)
"""From the first double quote to the last: a quoted value may itself hold quotes."""
_NUMBER = re.compile(r"\d{4,}")
_CARDLIKE = re.compile(r"\d(?:[ -]?\d){11,}")
"""12 digits or more, maybe in groups: a card or account number, even where a name is kept
(SQL that double-quotes a value makes it an identifier: ``column "4111..." does not
exist``). Names of ours never hold one (a day partition's has 8)."""
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s]*@")
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)
_TRAILERS = re.compile(r"\n(?:DETAIL|HINT|CONTEXT|QUERY|LINE \d+|WHERE|STATEMENT):.*", re.DOTALL)
"""What psycopg appends after the primary message: rows, keys and the statement's text."""
_DIAG_NAMES = ("schema_name", "table_name", "column_name", "constraint_name")
_INIT_DB = "run your migrations; consumerdedup's own tables: consumerdedup init-db"


def _template(pattern: str) -> re.Pattern[str]:
    """A whole message: ``{id}`` a quoted name (kept), ``{name}`` a bare one (kept),
    ``{type}`` a type name (kept), ``{value}`` a quoted value (masked)."""
    groups = {
        "id": r'"(?P<id{}>[^"]*)"',
        "name": r"(?P<id{}>[\w.$\"-]+)",
        "type": r"(?P<id{}>[\w .,()\[\]]+?)",
        "value": r'(?P<value{}>".*")',
    }
    pieces = re.split(r"\{(id|name|type|value)\}", pattern)
    regex = "".join(
        re.escape(piece) if i % 2 == 0 else groups[piece].replace("{}", str(i))
        for i, piece in enumerate(pieces)
    )
    return re.compile(regex + r"\Z", re.DOTALL)


_KNOWN = tuple(
    _template(p)
    for p in (
        # PostgreSQL (lc_messages English; in another language nothing matches: all masked)
        "relation {id} does not exist",
        "relation {id} already exists",
        "column {id} does not exist",
        "column {id} of relation {id} does not exist",
        "column {name} does not exist",
        "schema {id} does not exist",
        "type {id} does not exist",
        "missing FROM-clause entry for table {id}",
        "permission denied for {type} {name}",
        "permission denied for database {id}",
        "duplicate key value violates unique constraint {id}",
        "conflicting key value violates exclusion constraint {id}",
        "new row for relation {id} violates check constraint {id}",
        "null value in column {id} of relation {id} violates not-null constraint",
        "null value in column {id} violates not-null constraint",
        "insert or update on table {id} violates foreign key constraint {id}",
        "update or delete on table {id} violates foreign key constraint {id} on table {id}",
        "no partition of relation {id} found for row",
        "invalid input syntax for type {type}: {value}",
        "invalid input value for enum {name}: {value}",
        "database {id} does not exist",
        "role {id} does not exist",
        "role {id} is not permitted to log in",
        "password authentication failed for user {id}",
        "database {id} is not currently accepting connections",
        # SQLite
        "no such table: {name}",
        "no such column: {name}",
        "table {name} has no column named {name}",
        "UNIQUE constraint failed: {type}",
        "NOT NULL constraint failed: {name}",
    )
)

_SERVER = re.compile(
    r'connection to server (?:at "(?P<host>[^"]*)", port (?P<port>\d+)'
    r'|on socket "(?P<socket>[^"]*)") failed: '
)
"""libpq's words for each address it tried; what follows up to the next is why."""
_RESOLVE = re.compile(r"failed to resolve host '(?P<host>[^']*)': (?P<why>[^\n]*)\Z")


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


def mask_passwords(text: str) -> str:
    """``scheme://user:***@host`` and ``password=***``, wherever they stand in ``text``."""
    return _DSN_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))


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
    if _SERVER.search(raw) or _RESOLVE.search(raw):
        return _connection_text(raw)
    text = masked(raw)
    if fix := _fix(state, getattr(error, "sqlite_errorname", None), text):
        text = f"{text}: {fix}"
    facts = [
        f"{n.removesuffix('_name')} {v}"
        for n in _DIAG_NAMES
        if (v := getattr(diag, n, None)) and f'"{v}"' not in text
    ]
    if state:
        facts.insert(0, f"SQLSTATE {state}")
    return _CARDLIKE.sub(MASK, f"{text} ({'; '.join(facts)})" if facts else text)


def masked(message: str) -> str:
    """A database's message with its values masked: a message we know keeps its names and
    masks only its value slots; any other has everything quoted and long numbers masked."""
    message = message.strip()
    for known in _KNOWN:
        if match := known.match(message):
            out, last = [], 0
            for slot in match.groupdict():
                if slot.startswith("value"):
                    start, end = match.span(slot)
                    out.append(message[last:start] + f'"{MASK}"')
                    last = end
            return "".join(out) + message[last:]
    return _NUMBER.sub(MASK, _QUOTED.sub(f'"{MASK}"', message))


def _connection_text(raw: str) -> str:
    """libpq's "connection to server at "host", port N failed: why" for each address tried:
    the host and port kept, each why masked as a message and followed by its fix."""
    if resolve := _RESOLVE.search(raw):
        host = resolve["host"]
        return (
            f"cannot resolve the host {host!r} ({_NUMBER.sub(MASK, resolve['why'])}): "
            "check the host in the database URL"
        )
    prefix = raw[: _SERVER.search(raw).start()]  # type: ignore[union-attr]
    matches = list(_SERVER.finditer(raw))
    parts = []
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(raw)
        why = raw[match.end() : end].split("\n\t")[0].strip()  # the libpq hint: our fix says it
        why = why.removeprefix("FATAL:").strip()
        where = (
            f"socket {match['socket']}" if match["socket"] else f"{match['host']}:{match['port']}"
        )
        said = masked(why)
        fix = _connection_fix(said, where)
        parts.append(f"{match.group(0)}{said}" + (f": {fix}" if fix else ""))
    return (prefix if prefix.strip() else "") + " ".join(parts)


def _connection_fix(said: str, where: str) -> str | None:
    if said.startswith("database "):
        return "check the database name in the URL (or create that database)"
    if said.startswith("role ") and "does not exist" in said:
        return "check the user (role) in the URL (or create that role)"
    if said.startswith("role "):
        return "grant that role LOGIN, or use another user in the URL"
    if said.startswith("password authentication failed"):
        return "check that user's password in the URL"
    if "Connection refused" in said or "timeout expired" in said or "No route" in said:
        return f"check the host and port in the URL ({where}) and that PostgreSQL runs there"
    if "too many clients" in said:
        return "the server is out of connections: lower the pool sizes or raise max_connections"
    return None


def _fix(state: str | None, sqlite_name: str | None, text: str) -> str | None:
    """What to do about a setup fault, by SQLSTATE (or SQLite's words)."""
    if state in ("42P01", "42703", "3F000", "42704") or (
        sqlite_name == "SQLITE_ERROR"
        and text.startswith(("no such table", "no such column", "table "))
    ):
        return _INIT_DB
    if state == "42501":
        return "grant the role the rights it needs on it (or connect as a role that has them)"
    if state == "25006" or sqlite_name == "SQLITE_READONLY":
        return (
            "the database accepts no writes: connect to the primary, not a standby, and "
            "check default_transaction_read_only (SQLite: the file's permissions, mode=ro)"
        )
    if state in ("3D000",):
        return "check the database name in the URL (or create that database)"
    if state in ("28000", "28P01"):
        return "check the user and the password in the URL"
    return None
