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
from ..options import boolean, duration, integer, mapping, maybe, names, refuse, settle
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
        option = "PrunerConfig."
        selected = maybe(self.consumers, option + "consumers", names)
        if selected is not None:
            selected = tuple(sorted(set(selected)))
        common = check_window(scoped(self.retention, selected), option + "retention")
        buffer = check_window(self.buffer, option + "buffer", none="for the default buffer")
        windows = maybe(self.windows, option + "windows", mapping)
        own = {
            name: check_window(plain(window), f"{option}windows[{name!r}]")
            for name, window in (windows or {}).items()
        }
        settle(self, "batch_size", integer(self.batch_size, option + "batch_size", at_least=1))
        settle(self, "batch_pause", duration(self.batch_pause, option + "batch_pause", zero=True))
        check_window(self.outbox_keep, option + "outbox_keep", none="to leave the outbox alone")
        keys = self.idempotency_keep
        if isinstance(keys, str) or not (keys is None or isinstance(keys, timedelta)):
            if keys != EXPIRY:
                raise refuse(option + "idempotency_keep", keys, f"a timedelta, {EXPIRY!r} or None")
        else:
            check_window(keys, option + "idempotency_keep", none="to leave that table alone")
        settle(self, "dry_run", boolean(self.dry_run, option + "dry_run"))
        if selected is not None:
            settle(self, "consumers", selected)
        if windows is not None:
            settle(self, "windows", windows)  # a copy: the caller's may change
        settle(self, "keep", Keep.of(common, buffer, own, selected))

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
