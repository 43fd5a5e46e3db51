"""The replay of a dead-letter queue, whatever the client: RabbitMQ through pika
(consumerdedup.failed.rabbitmq) and Celery's broker through kombu
(consumerdedup.failed.celery) take, judge, forget, send and ack in the same rounds; only
how a letter is read, sent, acked and given back differs, and that is the ``Letters``
each brings. (A Kafka DLQ is replayed by offsets, not by acks: consumerdedup.failed.kafka.)

The order is what makes a kill harmless: a batch's FAILED records are forgotten before
any copy is sent, a dead letter is acked only after its copy was sent (confirmed, where
the broker confirms), and what is not acked goes back to the DLQ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from sqlalchemy import Engine

from ..schema import Tables
from .records import forget
from .report import DeadLetter, ReplayReport
from .selection import UNRECORDED, Selection, judge

BATCH = 100
"""Dead letters taken per round: one DELETE forgets their records."""
PASSED_OVER = "not taken by the selection"

Held = TypeVar("Held")


class Letters(Protocol[Held]):
    """One dead-letter queue as a replay sees it; ``Held`` is the client's handle on a
    letter taken and not yet acked (a delivery tag, a kombu message)."""

    def take(self, count: int) -> list[tuple[Held, DeadLetter]]:
        """Up to ``count`` letters, unacked; fewer when the queue runs dry."""

    def unreplayable(self, held: Held, letter: DeadLetter) -> str | None:
        """Why this letter cannot go back, from the letter alone (None: it can)."""

    def vetted(
        self, batch: Sequence[tuple[Held, DeadLetter]], verdicts: list[str | None]
    ) -> list[str | None]:
        """``verdicts`` with those still going (None) that the broker would refuse now,
        asked once a batch and before the forget (RabbitMQ: a source queue deleted since)."""

    def send(self, held: Held, letter: DeadLetter) -> str | None:
        """The copy sent to its queue and confirmed; why not, if the broker refused it."""

    def ack(self, held: Held) -> None: ...

    def give_back(self, held: Held) -> None:
        """The letter back to the DLQ, in its place."""


def replay_rounds(
    engine: Engine,
    tables: Tables,
    letters: Letters[Any],
    todo: int,
    report: ReplayReport,
    *,
    limit: int | None,
    selection: Selection,
    dry_run: bool,
    on_confirmed: Callable[[DeadLetter], Any] | None,
) -> None:
    """Replay up to ``limit`` of the ``todo`` letters the queue held at the start (never
    those dead-lettered again meanwhile), into ``report``. With ``dry_run`` nothing is
    forgotten, sent or acked: every letter taken is given back."""
    held: list[Any] = []  # given back at the end: kept, passed over, or a dry run's
    while todo > 0:
        chosen = len(report.replayed) + len(report.kept)
        count = min(BATCH, todo, BATCH if limit is None else limit - chosen)
        batch = letters.take(count) if count > 0 else []
        if not batch:
            break
        todo -= len(batch)
        judged = judge(engine, tables, [letter for _, letter in batch], selection)
        verdicts = letters.vetted(
            batch,
            [
                PASSED_OVER
                if not taken
                else letters.unreplayable(h, letter)
                or (UNRECORDED if selection.only_recorded and not recorded else None)
                for (h, letter), (taken, recorded) in zip(batch, judged, strict=True)
            ],
        )
        # Only what can go back is forgotten: a letter kept keeps its FAILED record listed.
        going = [letter for (_, letter), why in zip(batch, verdicts, strict=True) if why is None]
        report.forgotten += _forget(engine, tables, going, dry_run)
        for (h, letter), why, (_, recorded) in zip(batch, verdicts, judged, strict=True):
            if why is None and not dry_run:
                why = letters.send(h, letter)
            if why is not None:
                if why is PASSED_OVER:
                    report.skipped += 1
                else:
                    report.kept.append((letter, why))
                held.append(h)
                continue
            report.replayed.append(letter)
            if not recorded:
                report.unrecorded.append(letter)
            if dry_run:
                held.append(h)
                continue
            if on_confirmed is not None:
                on_confirmed(letter)
            letters.ack(h)
    for h in held:
        letters.give_back(h)


def _forget(engine: Engine, tables: Tables, going: Sequence[DeadLetter], dry_run: bool) -> int:
    """Forget the batch's FAILED records, per consumer, before any copy is sent."""
    by_consumer: dict[str, list[str]] = {}
    for letter in going:
        if letter.consumer and letter.message_id:
            by_consumer.setdefault(letter.consumer, []).append(letter.message_id)
    return sum(
        len(forget(engine, consumer, ids, dry_run=dry_run, tables=tables))
        for consumer, ids in by_consumer.items()
    )


def text(value: Any) -> str | None:
    """A header's value as text (bytes decoded, undecodable bytes replaced); None kept."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)
