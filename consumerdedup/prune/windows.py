"""How long a dedup record must be kept: the retention window, the buffer, and the broker's word.

The rule: a processed_events row may be deleted only when it is older than
retention + buffer, where retention is how long the broker can still deliver
the message again and the buffer covers what the broker's number leaves out
(clock skew between hosts, a consumer holding a message unacked, a lagging
consumer, a segment not yet deleted). ``None`` as a window means "kept forever".

The arithmetic of a round is here too: ``Keep`` (each consumer's window plus
its buffer) and, at a round's ``now``, its ``Cutoffs``; whole partitions go
only up to the earliest cutoff of all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from .. import durations
from ..errors import ConfigurationError, ConsumerDedupError
from ..options import duration, refuse

LONGEST = timedelta(days=36500)
"""Windows beyond a century are "forever" in disguise: say None instead."""
MIN_BUFFER = timedelta(days=1)
BUFFER_SHARE = 0.10
"""The default buffer: the larger of MIN_BUFFER and this share of the retention."""


class UnknownConsumer(ConfigurationError):
    """A consumer named explicitly has no records at all: most likely a typo."""


class RetentionUnknown(ConsumerDedupError):
    """The broker does not say how long it keeps messages: the window must be given explicitly."""


def check_window(
    value: object, what: str, *, allow_none: bool = True, none: str = "to keep records forever"
) -> timedelta | None:
    """``value`` if it is a usable window (a positive timedelta, or None: ``none`` says what
    None means for this option)."""
    if value is None and allow_none:
        return None
    note = f"or None {none}" if allow_none else ""
    if isinstance(value, timedelta) and value > LONGEST:
        hint = "pass None to keep records forever" if allow_none else "it must be finite"
        raise refuse(what, value, f"a window of at most a century ({hint})")
    return duration(value, what, note=note)


def default_buffer(retention: timedelta) -> timedelta:
    """max(1 day, 10% of the retention)."""
    return max(MIN_BUFFER, retention * BUFFER_SHARE)


@dataclass(frozen=True)
class SourceRetention:
    """How long one topic or queue can deliver a message again; None: forever."""

    source: str
    window: timedelta | None
    detail: str
    """Where the number came from, e.g. ``retention.ms=604800000 + segment.ms=86400000``."""

    def describe(self) -> str:
        shown = "forever" if self.window is None else durations.render(self.window)
        return f"{self.source}: {shown} ({self.detail})"


@dataclass(frozen=True)
class BrokerRetention:
    """The broker's answer for the sources a consumer reads: the longest of them wins."""

    broker: str
    sources: tuple[SourceRetention, ...]

    @classmethod
    def of(cls, broker: str, sources: Iterable[SourceRetention]) -> BrokerRetention:
        found = tuple(sources)
        if not found:
            raise ConfigurationError("no topics or queues given to read the retention of")
        return cls(broker, found)

    @property
    def window(self) -> timedelta | None:
        """None when any source keeps messages forever, else the longest window."""
        windows = [s.window for s in self.sources]
        if any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @property
    def names(self) -> str:
        return ", ".join(s.source for s in self.sources)

    @property
    def forever(self) -> Sequence[SourceRetention]:
        return [s for s in self.sources if s.window is None]

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.sources)


Window = timedelta | BrokerRetention | None
"""A retention as the Pruner takes it: a timedelta, None for forever, or the broker's word."""


def scoped(retention: Window, consumers: Iterable[str] | None) -> timedelta | None:
    """The common retention as a plain window; a broker's only with the consumers named.

    A window read from a broker is how long *its* topics or queues can deliver
    again; other consumers may read sources that keep messages longer, and
    pruning them by it would let a redelivery find no record.
    """
    if not isinstance(retention, BrokerRetention):
        return retention
    if consumers is None:
        raise ConfigurationError(
            f"the retention read from {retention.broker} applies only to the consumers of "
            f"{retention.names}: name them with consumers=[...]"
        )
    return retention.window


def plain(window: Window) -> timedelta | None:
    """A consumer's own window: a broker's applies to that consumer alone, so it is scoped."""
    return window.window if isinstance(window, BrokerRetention) else window


def keep_for(window: timedelta | None, buffer: timedelta | None) -> timedelta | None:
    """How old a record of that window must be before it goes: window + buffer (None: never)."""
    return None if window is None else window + (buffer or default_buffer(window))


@dataclass(frozen=True)
class Cutoffs:
    """One round's cutoffs: a consumer's records older than its cutoff go; None keeps them."""

    named: Mapping[str, datetime | None]
    """Per consumer named in ``consumers`` or ``windows``."""
    others: datetime | None
    """Every other consumer; None: they are not this round's (or are kept forever)."""

    @property
    def shown(self) -> dict[str, datetime | None]:
        """As a PruneReport gives them: ``"*"`` for every other consumer, when they are pruned."""
        return {**self.named, **({"*": self.others} if self.others is not None else {})}

    def whole_partitions(self) -> datetime | None:
        """Whole partitions may go up to the earliest cutoff, if every consumer has one.

        A partition holds every consumer's rows: one consumer whose records are
        not this round's to delete (``consumers=`` restricts it, so ``others`` is
        None) or kept forever keeps every partition.
        """
        if self.others is None or any(c is None for c in self.named.values()):
            return None
        return min([self.others, *(c for c in self.named.values() if c is not None)])


@dataclass(frozen=True)
class Keep:
    """How old a record must be before it goes, per consumer: its window plus the buffer."""

    named: Mapping[str, timedelta | None]
    """Per consumer named (sorted); None: kept forever."""
    others: timedelta | None
    """Every consumer not named; None: not pruned (``consumers=`` given, or no common window)."""

    @classmethod
    def of(
        cls,
        common: timedelta | None,
        buffer: timedelta | None,
        own: Mapping[str, timedelta | None],
        selected: Sequence[str] | None,
    ) -> Keep:
        """``common`` for every consumer without a window in ``own``; only ``selected``, if given.

        ``buffer`` None: each window gets its default buffer (see default_buffer).
        """
        named = selected if selected is not None else sorted(own)
        return cls(
            {name: keep_for(own.get(name, common), buffer) for name in named},
            keep_for(common, buffer) if selected is None else None,
        )

    def cutoffs(self, now: datetime) -> Cutoffs:
        """The round's cutoffs at ``now``: rows processed before ``now - keep`` go."""
        return Cutoffs(
            {name: None if keep is None else now - keep for name, keep in self.named.items()},
            None if self.others is None else now - self.others,
        )
