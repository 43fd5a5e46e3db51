"""Writes a pipeline transaction holds back until just before its COMMIT, to lock in one order.

Two batches whose handlers take the same per-key locks in opposite orders
deadlock: PostgreSQL detects it after ``deadlock_timeout`` (1 s by default),
aborts one, and the pair falls to a few messages a second. The claim's row
locks are taken in key order already (the claim's rows are sorted). The other
locks of ours are ``Outbox.add``'s per-key advisory locks, taken as each
handler adds its event, so in delivery order. Inside a pipeline transaction
they are held back instead: ``Outbox.add`` queues its row here (its event id is
returned at once) and the driver, just before COMMIT, flushes each queue: the
keys' locks in one order (by hash, as the claim lock of a partitioned table),
then the rows in the order they were added. The per-key promise is unchanged: a
key's lock is held from before its row is numbered until COMMIT.

The drivers open a queue for each attempt's transaction (``open_queue``), flush it
at COMMIT, and drop it at a rollback and when the attempt ends (``discard``), so
outside a pipeline transaction nothing is queued and ``Outbox.add`` writes at once,
even on a session a factory hands out again.
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConfigurationError

KEY = "consumerdedup.before_commit"


class Deferred(Protocol):
    """A batch of held-back writes, carried out by ``flush`` (or ``flush_async``)."""

    def flush(self, session: Session) -> None: ...

    async def flush_async(self, session: AsyncSession) -> None: ...


def open_queue(session: Session | AsyncSession, what: str = "a deduplicator") -> None:
    """Start holding back writes in ``session``'s transaction: a fresh queue (an earlier
    attempt on a reused session dropped its own when it ended).

    A queue still open is another pipeline's attempt in progress on this very session (a
    scoped_session shared by two deduplicators, one's handler calling the other's):
    joining it, our COMMIT would commit that transaction halfway and its held-back writes
    would be lost. Refused (ConfigurationError) before anything of ours touches it.
    """
    if isinstance(session.info.get(KEY), dict):
        raise ConfigurationError(
            f"{what}: the session factory gave a session another deduplicator's transaction "
            "is using (a scoped_session shared by two deduplicators, one's handler calling "
            "the other's); give each deduplicator its own sessionmaker"
        )
    session.info[KEY] = {}


def queue(session: Session | AsyncSession) -> dict[Any, Any] | None:
    """The open queue of ``session``'s transaction (name -> Deferred), or None."""
    found = session.info.get(KEY)
    return found if isinstance(found, dict) else None


def discard(session: Session | AsyncSession) -> None:
    """The transaction is rolled back: what it held back goes with it."""
    session.info.pop(KEY, None)


class _SavepointBelow:
    """In a queue: a savepoint was made below SQLAlchemy (``savepoint_below``)."""

    def flush(self, session: Session) -> None:
        """Nothing to write."""

    async def flush_async(self, session: AsyncSession) -> None:
        """Nothing to write."""


_BELOW = ("~savepoint below",)
BELOW_MESSAGE = (
    "a keyed Outbox.add is held back until just before the pipeline's COMMIT, so a savepoint "
    "made on the raw driver connection (SQL sent through it, or psycopg's transaction()) "
    "cannot undo it: use session.begin_nested() (or Connection.begin_nested()) in a handler "
    "that adds keyed outbox events"
)


def savepoint_below(session: Session | AsyncSession, unseen: bool = False) -> None:
    """A savepoint statement SQLAlchemy did not send (the raw driver connection's): what the
    transaction holds back cannot follow it, so if anything is held already,
    ConfigurationError (fail closed: a rolled back event would be written and published).
    ``unseen``: its RELEASE or ROLLBACK TO will not be seen either (psycopg's
    ``transaction()``): nothing more is held back (``below``) until ``seen_through``."""
    held = queue(session)
    if held is None:
        return
    if unseen:
        held[_BELOW] = _SavepointBelow()
    if any(getattr(deferred, "held", None) for deferred in held.values()):
        raise ConfigurationError(BELOW_MESSAGE)


def below(held: dict[Any, Any]) -> bool:
    """A savepoint whose end cannot be seen was made in the transaction of queue ``held``."""
    return _BELOW in held


def seen_through(session: Session | AsyncSession) -> None:
    """The handler call that made such a savepoint is over (its ``with`` block with it)."""
    held = queue(session)
    if held is not None:
        held.pop(_BELOW, None)


def path_may_change(session: Session | AsyncSession, sql: str) -> None:
    """``sql``, about to be sent on the transaction's connection, may change search_path:
    each held-back batch that cares says so (raises) before it is sent."""
    held = queue(session)
    for deferred in list((held or {}).values()):
        check = getattr(deferred, "path_may_change", None)
        if check is not None:
            check(held, sql)


def _taken(session: Session | AsyncSession) -> list[Deferred]:
    held = session.info.pop(KEY, None) or {}
    return [held[name] for name in sorted(held, key=repr)]  # one order across batches too


def flush(session: Session) -> None:
    """Carry out what the transaction held back; call right before COMMIT."""
    for deferred in _taken(session):
        deferred.flush(session)


async def flush_async(session: AsyncSession) -> None:
    """``flush`` on an AsyncSession."""
    for deferred in _taken(session):
        await deferred.flush_async(session)
