"""The operations the decision logic asks a driver to carry out, and what an attempt reports.

Each operation is answered with a value sent back into the logic, or with
the exception it raised thrown back in.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from .message import Message


@dataclass(frozen=True, slots=True)
class Execute:
    """Run ``statement`` with ``params``; send back ``read(result)``."""

    statement: Any
    params: Any
    read: Any


@dataclass(frozen=True, slots=True)
class CallHandler:
    """Call the user's handler with the message and the session."""

    message: Message


@dataclass(frozen=True, slots=True)
class Savepoint:
    """Open a savepoint; send back its handle."""


@dataclass(frozen=True, slots=True)
class EndSavepoint:
    handle: Any
    commit: bool


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Rollback:
    pass


@dataclass(frozen=True, slots=True)
class AttemptReport:
    pending: bool
    """Some messages are still undecided: attempt again."""
    backoff: bool
    """Wait before that attempt (not when the news was only a twin's commit or a batch to redo)."""


Op = Execute | CallHandler | Savepoint | EndSavepoint | Commit | Rollback
Attempt = Generator[Op, Any, AttemptReport]
