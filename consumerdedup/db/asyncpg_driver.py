"""What asyncpg says of its transaction, without a round trip, and what it cannot say.

asyncpg keeps the status byte of the server's last ReadyForQuery, but shows only
whether a transaction block is open (``Connection.is_in_transaction()``: in one, or in
one that failed), not whether it was aborted. So on asyncpg the guard reads locally
whether the transaction is still open, and asks the server whether it is still good:
PostgreSQL refuses any statement in an aborted transaction (25P02), and a SAVEPOINT
outside one (25P01), so one statement of ours, sent with the COMMIT in the same round
trip (dedup.asyncpg_watch), tells both.

SQLAlchemy reaches asyncpg through its adapter (``AsyncAdapt_asyncpg_connection``, the
pool's DB-API connection); its ``autocommit`` is the adapter's own setting (no BEGIN is
ever sent), not asyncpg's, and is read there.
"""

from __future__ import annotations

from typing import Any

try:
    import asyncpg  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - asyncpg is an extra
    asyncpg = None


def is_asyncpg(driver_connection: object) -> bool:
    """``driver_connection`` is asyncpg's own connection (not a wrapper around one)."""
    return asyncpg is not None and isinstance(driver_connection, asyncpg.Connection)


def in_transaction(driver_connection: Any) -> bool:
    """asyncpg says a transaction block is open (good or aborted: it cannot tell)."""
    return bool(driver_connection.is_in_transaction())


def adapter_autocommits(dbapi_connection: object) -> bool:
    """SQLAlchemy's asyncpg adapter sends no BEGIN (``autocommit`` set on it, by
    ``isolation_level="AUTOCOMMIT"`` or a connect listener)."""
    if asyncpg is None or not is_asyncpg(getattr(dbapi_connection, "driver_connection", None)):
        return False
    return getattr(dbapi_connection, "autocommit", False) is True
