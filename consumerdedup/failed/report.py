"""What a replay did, whatever the broker: the dead letters it read, and their fate."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A dead letter as the replay read it; ``source`` None when it cannot go back."""

    consumer: str | None
    message_id: str | None
    source: str | None
    reason: str | None


@dataclass
class ReplayReport:
    """What a replay did: the dead letters republished (with ``dry_run``: that would be),
    of them those that had no record at all (``unrecorded``), how many FAILED records were
    forgotten, those left in the DLQ with why (``kept``), and how many the selection
    passed over (``skipped``, left in the DLQ too)."""

    dead_letter_queue: str
    replayed: list[DeadLetter] = field(default_factory=list)
    forgotten: int = 0
    kept: list[tuple[DeadLetter, str]] = field(default_factory=list)
    unrecorded: list[DeadLetter] = field(default_factory=list)
    skipped: int = 0

    @property
    def outcome(self) -> str:
        """``done`` (nothing kept), ``partly`` (some replayed, some kept) or ``failed``
        (some kept, none replayed)."""
        if not self.kept:
            return "done"
        return "partly" if self.replayed else "failed"
