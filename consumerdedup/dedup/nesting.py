"""A message decided inside a handler that is deciding the same message: refused.

``process_once`` (and a Celery task applied eagerly, a FastStream TestBroker publishing
from a handler) can be called from a handler's body. For another key that is only a
second, separate transaction. For the same key on the same table it can never end: the
inner claim waits on the row the outer transaction inserted and has not committed, and
the outer transaction waits for the inner call to return. So a processor entered with a
key that an enclosing processor of this context is deciding raises ConfigurationError
instead of waiting forever: a handler that meets it fails its message (FAILED, as it
would every time), never left hanging.

The keys in flight are a context variable: a nested call in the same thread or asyncio
task (and in what it hands on with its context: ``asyncio.to_thread``, a new task) sees
them; a separate thread started without the context does not, and waits as any twin
delivery does until the outer transaction ends.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..errors import ConfigurationError
from .pipeline import Delivered

__all__ = ["deciding"]

Held = frozenset[tuple[str, str, str, object]]
_HELD: contextvars.ContextVar[Held] = contextvars.ContextVar(
    "consumerdedup_keys_in_flight", default=frozenset()
)


@contextmanager
def deciding(
    database: str, table: str, consumer: str, delivered: Sequence[Delivered]
) -> Iterator[None]:
    """Holds ``delivered``'s keys as in flight for the block; ConfigurationError if an
    enclosing block of this context holds one of them (see the module)."""
    held = _HELD.get()
    keys = {(database, table, consumer, message.id) for message, _ in delivered}
    keys = {key for key in keys if isinstance(key[3], str)}
    nested = sorted(str(key[3]) for key in keys & held)
    if nested:
        raise ConfigurationError(
            f"consumer {consumer!r}: message {nested[0][:64]!r} is being decided by a call "
            "of this thread or task that is still running (process_once, or a task or a "
            "subscriber called from its own handler): its claim would wait forever on the "
            "enclosing call's uncommitted record; decide it after that call returns"
        )
    token = _HELD.set(held | keys)
    try:
        yield
    finally:
        _HELD.reset(token)
