"""The savepoints one handler call opened, so that it cannot roll back to another's.

In a batch the handlers run back to back in one transaction. A savepoint a handler
left open (a forgotten RELEASE, a ``begin_nested()`` never closed) is still there when
the next handler runs, and PostgreSQL and SQLite let a ``ROLLBACK TO`` reach it: the
later handler would undo the earlier message's writes while that message is reported
PROCESSED. Every statement of a call is read already (db.control_sql, before it is
sent); its savepoint statements are followed here by name, as the server resolves them
(the latest savepoint of that name), and a ``ROLLBACK TO`` a savepoint this call did not
open is refused before it is sent. It costs nothing on the wire: no savepoint of ours
around each handler (that would cost two round trips a message in a batch).

Not followed: savepoints made below the watched cursors (psycopg's
``Connection.transaction()`` and ``pgconn.exec_``, which use no cursor).
"""

from __future__ import annotations

from ..db.control_sql import savepoint_steps


class CallSavepoints:
    """The savepoint names one handler call opened and has not released, in order."""

    __slots__ = ("opened",)

    def __init__(self) -> None:
        self.opened: list[str | None] = []

    def follow(self, statement: str, dialect: str) -> str | None:
        """Follow ``statement``'s savepoint statements; the reason to refuse it, or None."""
        for verb, name in savepoint_steps(statement, dialect):
            opened = self.opened
            if verb == "SAVEPOINT":
                opened.append(name)
                continue
            at = _last(opened, name)
            if verb == "RELEASE":  # one opened before this call takes all of this call's along
                del opened[max(at, 0) :]
            elif at < 0:
                return (
                    f"the handler sent ROLLBACK TO SAVEPOINT {name or '(a name not readable)'}, "
                    "a savepoint it did not open in this call (one an earlier handler of the "
                    "same transaction left open): it would undo another message's writes; "
                    "release every savepoint a handler opens (use session.begin_nested() as a "
                    "context manager)"
                )
            else:
                del opened[at + 1 :]
        return None


def _last(opened: list[str | None], name: str | None) -> int:
    """Where the latest savepoint named ``name`` is (the one the server would take), or -1."""
    if name is None:
        return -1
    for at in range(len(opened) - 1, -1, -1):
        if opened[at] == name:
            return at
    return -1
