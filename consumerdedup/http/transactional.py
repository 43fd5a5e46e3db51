"""Transactional mode's guard: the endpoint must not end the request's transaction itself.

The claim row, the endpoint's writes and the stored response commit together
only if the middleware's commit is the one that happens. An endpoint that
commits would publish its writes and an in-flight claim with no response: a
crash then leaves the effect done and the key looking in flight. So a commit
inside the endpoint raises CommitInEndpoint (the request fails, everything
rolls back, nothing is stored); ``allow()`` lifts the guard for the
middleware's own commit. Shared by the ASGI and WSGI middleware.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from ..errors import ConsumerDedupError


class CommitInEndpoint(ConsumerDedupError):
    """A transactional endpoint committed the request's session: refused, all rolled back."""


def hold_commits(session: Session | AsyncSession) -> Callable[[], None]:
    """Refuse every commit on ``session`` until the returned ``allow()`` is called."""
    target = session.sync_session if isinstance(session, AsyncSession) else session
    allowed = False

    def refuse(_: Any) -> None:
        if not allowed:
            raise CommitInEndpoint(
                "a transactional idempotent endpoint called commit() on the request's session; "
                "leave the commit to the middleware (it commits your writes with the stored "
                "response), or make the route non-transactional"
            )

    def allow() -> None:
        nonlocal allowed
        allowed = True

    event.listen(target, "before_commit", refuse)
    return allow
