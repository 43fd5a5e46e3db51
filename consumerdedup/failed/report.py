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
    how many FAILED records were forgotten, and those left in the DLQ with why."""

    dead_letter_queue: str
    replayed: list[DeadLetter] = field(default_factory=list)
    forgotten: int = 0
    kept: list[tuple[DeadLetter, str]] = field(default_factory=list)
