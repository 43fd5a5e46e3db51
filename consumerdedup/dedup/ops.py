"""The operations the decision logic asks a driver to carry out, and what an attempt reports.

Each operation is answered with a value sent back into the logic, or with
the exception it raised thrown back in.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from ..message import Message


@dataclass(frozen=True, slots=True)
class Execute:
    """Run ``statement`` with ``params``; send back ``read(result)``."""

    statement: Any
    params: Any
    read: Any


@dataclass(frozen=True, slots=True)
class CallHandler:
    """Call the user's handler with the message and the session.

    The driver then checks that the transaction is still the pipeline's and
    alive, and throws TransactionBroken in if it is not.
    """

    message: Message


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
    """Wait before that attempt: not when it only redoes a span's innocent part or halves it."""


Op = Execute | CallHandler | Commit | Rollback
Attempt = Generator[Op, Any, AttemptReport]
