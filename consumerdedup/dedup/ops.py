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
    alive, and throws TransactionBroken in if it is not. What the handler's own
    code raised comes in as HandlerRaised (see ``handler_code``): the message's
    failure, whatever its type. Anything else thrown in here is the driver's.
    """

    message: Message


@dataclass(frozen=True, slots=True)
class CallBulk:
    """Call a bulk handler once with the messages, in order, and the session: checked
    like CallHandler; a failure names no message unless the handler says which."""

    messages: tuple[Message, ...]


class HandlerRaised(Exception):
    """What the user's code raised, as the driver throws it in at CallHandler.

    It carries the origin: a ConfigurationError the handler raised (a bad
    argument to ``Outbox.add``) is that message's failure, while one the driver
    raises on its own (a handler of the wrong kind) is a setup fault.
    """

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class _HandlerCode:
    """Around the user's code in a driver: whatever it raises comes out as HandlerRaised.
    (A class, not @contextmanager: entered twice a message, the generator cost more.)"""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, _traceback: Any) -> None:
        if isinstance(exc, Exception):
            raise HandlerRaised(exc) from exc


_HANDLER_CODE = _HandlerCode()


def handler_code() -> _HandlerCode:
    """Around the user's code in a driver: whatever it raises comes out as HandlerRaised."""
    return _HANDLER_CODE


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
    wait: float = 0.0
    """Seconds to wait before that attempt (the policy's backoff); 0 when it only redoes a
    span's innocent part or halves it."""


Op = Execute | CallHandler | CallBulk | Commit | Rollback
Attempt = Generator[Op, Any, AttemptReport]
