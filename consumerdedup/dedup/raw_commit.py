"""Refusing the raw DB-API connection's ``commit()`` while a handler runs.

Caught only afterwards, a raw commit would already have committed the batch's
claims (claim-first: the messages after it reported DUPLICATE, their handlers
never run) or its handlers' effects without their records (check-first: run
again). A rollback loses nothing, and SQLAlchemy's own rollback goes through
the raw connection: it is caught afterwards (handler_guard). psycopg's and
aiosqlite's ``commit`` is replaced on the instance for the call; sqlite3's
methods cannot be replaced, so its authorizer denies COMMIT instead (any
authorizer of the application's on that connection is removed). A driver
connection that takes neither is refused: the guard cannot hold on it.
"""

from __future__ import annotations

import inspect
import sqlite3
from collections.abc import Callable
from typing import Any

from ..errors import CommitInHandler, ConfigurationError

Refuse = Callable[[str], CommitInHandler]
"""Given the method's name, the error to raise (and the call notes that it happened)."""


def refuse_raw_commit(raw: Any, refuse: Refuse) -> Callable[[], None]:
    """Make ``raw.commit()`` raise ``refuse("commit")``; send back what lifts that."""
    if isinstance(raw, sqlite3.Connection):

        def authorize(action: int, *args: Any) -> int:
            if action == sqlite3.SQLITE_TRANSACTION and str(args[0]).upper() == "COMMIT":
                refuse("commit")
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK

        raw.set_authorizer(authorize)
        return lambda: raw.set_authorizer(None)
    for word in ("commit",):
        try:
            setattr(
                raw, word, _refusal(refuse, word, inspect.iscoroutinefunction(getattr(raw, word)))
            )
        except (AttributeError, TypeError) as exc:
            raise ConfigurationError(
                f"{type(raw).__name__}: its {word}() cannot be refused while a handler runs, so "
                "a handler could commit apart from the dedup record; use the DB-API module "
                "its dialect loads itself"
            ) from exc

    def unlock() -> None:
        vars(raw).pop("commit", None)

    return unlock


def _refusal(refuse: Refuse, word: str, coroutine: bool) -> Callable[..., Any]:
    if coroutine:

        async def refuse_async(*_args: Any, **_kwargs: Any) -> None:
            raise refuse(word)

        return refuse_async

    def refuse_now(*_args: Any, **_kwargs: Any) -> None:
        raise refuse(word)

    return refuse_now
