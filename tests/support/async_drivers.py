"""PostgreSQL's two asyncio drivers, for tests that run AsyncDeduplicator on both.

psycopg's async connection is read locally by the guard; asyncpg's aborted state is asked
of the server (consumerdedup.dedup.asyncpg_watch). The same test body runs on each.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

ASYNC_PG_DRIVERS = ["psycopg", "asyncpg"]


def async_url(url: Any, driver: str) -> str:
    """``url`` (any PostgreSQL URL) on ``driver`` (``psycopg`` or ``asyncpg``)."""
    return make_url(url).set(drivername=f"postgresql+{driver}").render_as_string(False)


def async_engine(url: Any, driver: str, **options: Any) -> AsyncEngine:
    return create_async_engine(async_url(url, driver), **options)
