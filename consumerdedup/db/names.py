"""SQL names: table names checked as identifiers, fitted to PostgreSQL's limit, quoted.

Table names are configurable and end up inside SQL text (partition DDL,
advisory-lock keys, the pruner's statements), so they are validated once
where they are defined and quoted the dialect's way wherever they are written.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import mysql, postgresql, sqlite

from ..options import matching

LONGEST = 63
"""PostgreSQL cuts identifiers at 63 bytes: a longer name would silently become another."""
_PART = r"[A-Za-z_][A-Za-z0-9_]{0,62}"
_TABLE_NAME = re.compile(rf"(?:{_PART}\.)?{_PART}")
TABLE_NAME = (
    "a table name of letters, digits and _ (at most 63 each, not starting with a digit), "
    "optionally as schema.table"
)


def split_name(name: object, option: str = "table name") -> tuple[str | None, str]:
    """Split ``"schema.table"`` and validate both parts as SQL identifiers."""
    schema, _, table = matching(name, option, _TABLE_NAME, TABLE_NAME).rpartition(".")
    return (schema or None, table)


def fit_name(prefix: str, table: str, what: str) -> str:
    """``<prefix><table>_<what>``, shortened with a hash to fit PostgreSQL's 63-character limit."""
    name = f"{prefix}{table}_{what}"
    if len(name) <= LONGEST:
        return name
    digest = hashlib.sha1(table.encode()).hexdigest()[:8]
    return f"{prefix}{table[: LONGEST - len(prefix) - len(what) - 10]}_{digest}_{what}"


def quote(name: str, dialect: str = "postgresql") -> str:
    """One identifier, quoted where the dialect needs it."""
    return str(_preparer(dialect).quote(name))


def table_sql(table: Table, dialect: str = "postgresql") -> str:
    """The table's name as SQL spells it (quoted where needed, schema included if given)."""
    return str(_preparer(dialect).format_table(table))


def _preparer(dialect: str) -> Any:
    """Quotes the way the dialect does, without an engine at hand."""
    module: Any = {"postgresql": postgresql, "mysql": mysql, "mariadb": mysql}.get(dialect, sqlite)
    return module.dialect().identifier_preparer
