"""PrunerConfig: what a Pruner deletes and how fast, validated at construction.

``Pruner(engine, retention, buffer, windows=..., ...)`` is a shortcut for
``Pruner(engine, config=PrunerConfig(retention, buffer, windows=..., ...))``:
the keywords are these fields (``PrunerSettings``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypedDict

from .. import durations
from ..errors import ConfigurationError
from .idempotency import EXPIRY
from .windows import Keep, Window, check_window, plain, scoped

DEFAULT_BATCH = 5000
DEFAULT_OUTBOX_KEEP = timedelta(days=7)


@dataclass(frozen=True)
class PrunerConfig:
    """Windows, what else a round deletes, and its pace; durations are ``timedelta``.

    ``retention`` applies to every consumer without a window of its own in
    ``windows`` (a mapping of consumer name to timedelta, or None to keep that
    consumer's records forever); ``retention=None`` prunes only the consumers
    in ``windows``. ``consumers`` restricts the round to the consumers named.
    A ``BrokerRetention`` (``kafka_retention``, ``rabbitmq_retention``) as
    ``retention`` needs ``consumers``: it is only the window of its topics or
    queues; as a value in ``windows``, it is that consumer's.
    """

    retention: Window
    buffer: timedelta | None = None
    """Added to each window; None: max(1 day, 10% of that window)."""
    windows: Mapping[str, Window] | None = None
    """Consumers with a window of their own (None as a window: kept forever)."""
    consumers: Iterable[str] | None = None
    """Only these consumers' records (kept as a sorted tuple); None: every consumer's."""
    outbox_keep: timedelta | None = DEFAULT_OUTBOX_KEEP
    """Published outbox rows older than this go; None leaves the outbox alone."""
    idempotency_keep: timedelta | str | None = EXPIRY
    """HTTP idempotency keys: EXPIRY deletes those past the expiry stored with each; a
    timedelta also those created longer ago; None leaves that table alone."""
    batch_size: int = DEFAULT_BATCH
    """Rows per batch; each batch is a transaction of its own."""
    batch_pause: timedelta = timedelta(0)
    """Between batches: leaves more of the database to the consumers on a busy server."""
    dry_run: bool = False
    """Count what a round would delete; delete nothing."""
    keep: Keep = field(init=False, repr=False, compare=False)
    """Derived: how old each consumer's records must be before they go (see windows.py)."""

    def __post_init__(self) -> None:
        common = check_window(scoped(self.retention, self.consumers), "retention")
        buffer = check_window(self.buffer, "buffer")
        own = {
            name: check_window(plain(window), f"window of consumer {_name(name)!r}")
            for name, window in (self.windows or {}).items()
        }
        names = self.consumers
        selected = None if names is None else tuple(sorted({_name(c) for c in names}))
        size = self.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"batch_size must be an int >= 1, not {size!r}")
        pause = self.batch_pause
        if not isinstance(pause, timedelta) or pause < timedelta(0):
            raise ConfigurationError(f"batch_pause must be a timedelta >= 0, not {pause!r}")
        check_window(self.outbox_keep, "outbox_keep")
        if self.idempotency_keep is not None and self.idempotency_keep != EXPIRY:
            check_window(self.idempotency_keep, f"idempotency_keep (or {EXPIRY!r}, or None)")
        if selected is not None:
            object.__setattr__(self, "consumers", selected)
        if self.windows is not None:
            object.__setattr__(self, "windows", dict(self.windows))  # the caller's may change
        object.__setattr__(self, "keep", Keep.of(common, buffer, own, selected))

    def describe(self) -> str:
        """What a round deletes, in one line: each consumer's keep, then the other tables."""
        parts = [f"{name} {_render(keep)}" for name, keep in self.keep.named.items()]
        if self.consumers is None:
            others = "other consumers" if parts else "every consumer"
            parts.append(f"{others} {_render(self.keep.others)}")
        outbox = self.outbox_keep
        tail = "outbox left alone" if outbox is None else f"published outbox rows {_render(outbox)}"
        keys = self.idempotency_keep
        if keys is None:
            tail += "; idempotency keys left alone"
        elif isinstance(keys, timedelta):
            tail += f"; idempotency keys past their expiry or older than {_render(keys)}"
        else:
            tail += "; idempotency keys past their stored expiry"
        basis = "" if self.buffer else ", buffer max(1d, 10%)"
        return f"deleting what is older than retention + buffer{basis}: {', '.join(parts)}; {tail}"


class PrunerSettings(TypedDict, total=False):
    """PrunerConfig's fields after ``retention`` and ``buffer``, as keywords of ``Pruner``."""

    windows: Mapping[str, Window] | None
    consumers: Iterable[str] | None
    outbox_keep: timedelta | None
    idempotency_keep: timedelta | str | None
    batch_size: int
    batch_pause: timedelta
    dry_run: bool


def _render(value: timedelta | None) -> str:
    return "forever" if value is None else durations.render(value)


def _name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a consumer name must be a non-empty str, not {name!r}")
    return name
