"""Masking: a database's message with its values masked and its names kept, and
passwords masked wherever they stand.

A message we know (``_KNOWN``: PostgreSQL's and SQLite's words for a missing or
refused object, a broken constraint, a bad value) keeps its names and masks only its
value slots; any other has everything quoted and every long number masked.
"""

from __future__ import annotations

import re

MASK = "..."

_QUOTED = re.compile(r'".*"', re.DOTALL)
"""From the first double quote to the last: a quoted value may itself hold quotes."""
NUMBER = re.compile(r"\d{4,}")
CARDLIKE = re.compile(r"\d(?:[ -]?\d){11,}")
"""12 digits or more, maybe in groups: a card or account number, even where a name is kept
(SQL that double-quotes a value makes it an identifier: ``column "4111..." does not
exist``). Names of ours never hold one (a day partition's has 8)."""
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@]*:)[^\s]*@")
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|\S+)", re.IGNORECASE)


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
    return NUMBER.sub(MASK, _QUOTED.sub(f'"{MASK}"', message))


def mask_passwords(text: str) -> str:
    """``scheme://user:***@host`` and ``password=***``, wherever they stand in ``text``."""
    return _DSN_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))
