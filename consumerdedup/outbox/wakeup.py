"""Waking the relays of this process when an outbox row commits (MySQL, MariaDB).

MySQL has no LISTEN/NOTIFY. A transaction that added outbox rows through ``Outbox.add``
bumps its outbox's counter here once its Session has committed, and every relay of the
same process waiting on that outbox wakes at once. Rows committed by other processes
are found by polling: an idle relay looks again every ``poll_interval`` with jitter
(listener.py). A missed wake-up costs latency, never a row: the relay's claim, not this
counter, decides what is published.
"""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy import event
from sqlalchemy.orm import Session

_changed = threading.Condition()
_counters: dict[str, int] = {}
_PENDING = "consumerdedup.outbox_wake"
"""Session.info: the outboxes this session's open transaction added rows to."""


def current(name: str) -> int:
    """The outbox's counter now: a relay reads it before its round, and waits for a change."""
    with _changed:
        return _counters.get(name, 0)


def bump(names: set[str]) -> None:
    if not names:
        return
    with _changed:
        for name in names:
            _counters[name] = _counters.get(name, 0) + 1
        _changed.notify_all()


def wait(name: str, seen: int, timeout: float) -> bool:
    """True as soon as the counter differs from ``seen``; False after ``timeout`` seconds."""
    with _changed:
        return _changed.wait_for(lambda: _counters.get(name, 0) != seen, timeout)


def after_commit(session: Session, name: str) -> None:
    """Bump ``name`` when ``session``'s transaction commits (nothing on a rollback)."""
    pending: set[str] | None = session.info.get(_PENDING)
    if pending is None:
        pending = session.info[_PENDING] = set()
        if not event.contains(session, "after_commit", _committed):
            event.listen(session, "after_commit", _committed)
            event.listen(session, "after_rollback", _rolled_back)
    pending.add(name)


def _committed(session: Session) -> None:
    bump(session.info.pop(_PENDING, None) or set())


def _rolled_back(session: Any) -> None:
    session.info.pop(_PENDING, None)
