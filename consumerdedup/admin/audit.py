"""The audit trail: every action the admin pages take, who took it, on what, how many
and why, as one JSON line on the ``consumerdedup.admin.audit`` logger (INFO), or given
to the ``audit`` callable of ``admin_app`` (to write it to a table of the application's
own). An action is written after it ran, with what it did; one that raised is written
with its error, then the error is shown."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

log = logging.getLogger("consumerdedup.admin.audit")
NAMED = 20
"""Ids written on the line at most (the count is always the whole)."""


@dataclass(frozen=True, slots=True)
class AuditEntry:
    """One action: who (the authorisation's name), as which role, what (``failed.forget``),
    on which (the consumer, the search), how many, why (the operator's reason)."""

    who: str
    role: str
    action: str
    target: dict[str, Any]
    count: int
    reason: str
    ids: Sequence[str] = ()
    error: str | None = None
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at.isoformat(),
            "who": self.who,
            "role": self.role,
            "action": self.action,
            "target": self.target,
            "count": self.count,
            "reason": self.reason,
            "ids": list(self.ids[:NAMED]),
            "error": self.error,
        }


Audit = Callable[[AuditEntry], None]


def log_entry(entry: AuditEntry) -> None:
    """The default audit: the entry as one JSON line at INFO."""
    log.info("%s", json.dumps(entry.as_dict(), default=str, sort_keys=True))


@contextmanager
def audited(
    app: Any, visitor: Any, action: str, target: dict[str, Any], reason: str
) -> Iterator[list[str]]:
    """Run an action inside the block and write its entry after it, whatever the block
    did: the block adds the ids it acted on to the list it is given; an exception is
    written by its type (never its text: it may hold parameters), then raised on."""
    done: list[str] = []
    error: str | None = None
    try:
        yield done
    except Exception as failure:
        error = type(failure).__name__
        raise
    finally:
        app.audit(
            AuditEntry(
                who=visitor.who,
                role=visitor.role.value,
                action=action,
                target=target,
                count=len(done),
                reason=reason,
                ids=done,
                error=error,
            )
        )
