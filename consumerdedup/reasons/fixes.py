"""What to do about a setup fault, said at the end of its reason: by SQLSTATE or
SQLite's words for a statement's error, by libpq's words for a refused connection."""

from __future__ import annotations

INIT_DB = "run your migrations; consumerdedup's own tables: consumerdedup init-db"


def statement_fix(state: str | None, sqlite_name: str | None, text: str) -> str | None:
    """The fix for a statement's setup fault (a missing table, a right not granted...)."""
    if state in ("42P01", "42703", "3F000", "42704") or (
        sqlite_name == "SQLITE_ERROR"
        and text.startswith(("no such table", "no such column", "table "))
    ):
        return INIT_DB
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


def connection_fix(said: str, where: str) -> str | None:
    """The fix for why one address refused the connection (``said``, already masked)."""
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
