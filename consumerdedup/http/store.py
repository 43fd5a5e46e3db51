"""The store contract: what the algorithm (flow.py) needs from wherever keys live.

A record is identified by (scope, key); scope is principal + method + route
(see flow.scope_of). One sentence per promise; the shared suite in tests/http
has a test for each, and every store (SQL, Redis) passes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol, runtime_checkable

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from .stored import StoredResponse


@dataclass(frozen=True)
class Claimed:
    """The caller holds the key: run the endpoint. ``token`` proves it to complete/release/renew."""

    token: str


@dataclass(frozen=True)
class InFlight:
    """Another request holds the key; its lease runs out in ``retry_after`` seconds at most."""

    retry_after: float


@dataclass(frozen=True)
class Completed:
    """The key's request finished: replay ``response`` (or say it was not stored)."""

    response: StoredResponse


@dataclass(frozen=True)
class Mismatch:
    """The key is live with another request's fingerprint: refuse, run nothing."""


ClaimResult = Claimed | InFlight | Completed | Mismatch


@runtime_checkable
class IdempotencyStore(Protocol):
    """A blocking store; every method is safe to call from several threads and processes."""

    def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        """Atomically: a new key, an expired record or an in-flight one whose lease ran out becomes
        in flight for ``lease`` under a fresh token (Claimed); a live record with another
        fingerprint answers Mismatch, else Completed or InFlight; two callers never both get
        Claimed while a lease holds."""
        ...

    def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool:
        """Extend the claim to now + ``lease`` if ``token`` still holds it; False if it was lost."""
        ...

    def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool:
        """Store ``response`` and mark the record completed until now + ``expiry``, only if
        ``token`` still holds the claim; False (nothing written) if it was lost."""
        ...

    def release(self, scope: str, key: str, token: str) -> None:
        """Remove the claim if ``token`` still holds it, so a retry runs from scratch; a lost
        claim is left alone."""
        ...


@runtime_checkable
class AsyncIdempotencyStore(Protocol):
    """IdempotencyStore's twin for asyncio: the same promises, awaited."""

    async def claim(
        self, scope: str, key: str, fingerprint: str, lease: timedelta
    ) -> ClaimResult: ...

    async def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool: ...

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool: ...

    async def release(self, scope: str, key: str, token: str) -> None: ...


@runtime_checkable
class TransactionalStore(Protocol):
    """A store whose records live in the application's database (SQL only).

    The claim is a row written in the request's own transaction, never
    committed apart: the endpoint's writes, its outbox events and the stored
    response commit together, and a crash or a rollback leaves no trace, so no
    lease is needed. A twin's claim waits on the row's lock; a wait longer than
    ``wait`` answers InFlight.
    """

    def claim_in(
        self,
        session: Session,
        scope: str,
        key: str,
        fingerprint: str,
        wait: timedelta,
        lease: timedelta | None = None,
    ) -> ClaimResult:
        """Claim in ``session``'s transaction (begun by the caller); Claimed means the row is
        written and locked until that transaction ends. ``lease`` is only a backstop: a
        claim row that got committed without its response becomes free after it."""
        ...

    def complete_in(
        self,
        session: Session,
        scope: str,
        key: str,
        response: StoredResponse,
        expiry: timedelta,
        token: str | None = None,
    ) -> None:
        """Write the response into the claimed row in ``session``'s transaction; the caller
        commits. With the claim's ``token``, raise ClaimLost (sql_store) unless this
        transaction still holds that claim (the endpoint may have rolled it back)."""
        ...


@runtime_checkable
class AsyncTransactionalStore(Protocol):
    """TransactionalStore's twin over AsyncSession."""

    async def claim_in(
        self,
        session: AsyncSession,
        scope: str,
        key: str,
        fingerprint: str,
        wait: timedelta,
        lease: timedelta | None = None,
    ) -> ClaimResult: ...

    async def complete_in(
        self,
        session: AsyncSession,
        scope: str,
        key: str,
        response: StoredResponse,
        expiry: timedelta,
        token: str | None = None,
    ) -> None: ...
