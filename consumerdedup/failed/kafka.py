"""Replay a Kafka dead-letter topic: forget the FAILED records, re-produce each dead letter
to the topic it came from (acks=all), then commit the replay group's offsets on the DLQ.

A dead letter names its source topic and its consumer in the headers the runner set
(``x-dead-letter-source``, ``x-dead-letter-consumer``), its id in the id header. The
replay reads from the group's committed offset (or ``from_offset``, or the beginning) up
to the end each partition had when it started, and commits a batch's offsets only after
every copy in it was acknowledged: killed at any point, what was not committed is read
again and re-produced, and a twin copy is answered by the dedup record (forget never
deletes a completed one). A record without an id header stops its partition there: its
copy would get a new id (its coordinates), and a repeated replay could apply it twice.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition  # type: ignore[import-untyped]
from sqlalchemy import Engine

from .. import options
from ..errors import ConfigurationError
from ..headers import CONSUMER_HEADER, ID_HEADER, REASON_HEADER, REPLAYED_HEADER, SOURCE_HEADER
from ..schema import DEFAULT, Tables
from . import KAFKA_GROUP
from .records import forget
from .report import DeadLetter, ReplayReport
from .selection import UNRECORDED, Selection, judge

GROUP = KAFKA_GROUP
_OURS_PREFIX = "x-dead-letter-"


def replay(
    engine: Engine,
    bootstrap_servers: str,
    dead_letter_topic: str,
    **options: Any,
) -> ReplayReport:
    """``replay_async`` on an event loop of its own."""
    return asyncio.run(replay_async(engine, bootstrap_servers, dead_letter_topic, **options))


async def replay_async(
    engine: Engine,
    bootstrap_servers: str,
    dead_letter_topic: str,
    *,
    tables: Tables = DEFAULT,
    group: str = GROUP,
    from_offset: int | None = None,
    limit: int | None = None,
    to: str | None = None,
    id_header: str = ID_HEADER,
    idempotent_producer: bool = False,
    dry_run: bool = False,
    on_confirmed: Callable[[DeadLetter], Any] | None = None,
    selection: Selection | None = None,
) -> ReplayReport:
    """Replay up to ``limit`` (None: all) dead letters of ``dead_letter_topic`` that
    ``selection`` takes (None: all) to their source topic (``to``: that topic instead).
    With ``dry_run`` nothing is forgotten, produced or committed. A partition's committed
    offset never passes a letter the selection passed over: the next replay, selecting
    otherwise, reads it again (and the letters replayed after it, answered then by their
    records)."""
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"limit must be a positive int or None, got {limit!r}")
    if from_offset is not None and (not isinstance(from_offset, int) or from_offset < 0):
        raise ConfigurationError(f"from_offset must be an int >= 0, got {from_offset!r}")
    selection = options.maybe(selection, "selection", options.instance, Selection, "a Selection")
    selection = selection or Selection()
    adapter: Any = importlib.import_module("consumerdedup.adapters.kafka")
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    publisher = adapter.KafkaPublisher(bootstrap_servers, enable_idempotence=idempotent_producer)
    report = ReplayReport(dead_letter_topic)
    await consumer.start()
    try:
        found = consumer.partitions_for_topic(dead_letter_topic)
        if not found:
            found = await _partitions(consumer, dead_letter_topic)
        partitions = [TopicPartition(dead_letter_topic, p) for p in sorted(found)]
        # A copy goes only to a topic that exists: a broker that auto-creates topics would
        # take a mistyped --to (or a deleted source) and the DLQ's offsets move past them.
        known = set(await consumer.topics())
        consumer.assign(partitions)
        ends = await consumer.end_offsets(partitions)
        for tp in partitions:
            start = from_offset
            if start is None:
                start = await consumer.committed(tp)
            if start is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, start)
        left = limit
        for tp in partitions:
            passed_over = False  # once one is, this partition's offset is not committed on
            while (left is None or left > 0) and await consumer.position(tp) < ends[tp]:
                fetched = await consumer.getmany(tp, timeout_ms=1000, max_records=100)
                batch = [r for r in fetched.get(tp, []) if r.offset < ends[tp]]
                if not batch:
                    continue
                chosen = _Chosen(engine, tables, selection, left)
                before = len(report.replayed) + len(report.kept)
                batch = chosen.cut(batch, id_header)
                done = await _replay_batch(
                    engine,
                    tables,
                    publisher,
                    chosen,
                    (to, known),
                    dry_run,
                    on_confirmed,
                    report,
                )
                if left is not None:
                    left -= len(report.replayed) + len(report.kept) - before
                passed_over = passed_over or chosen.skipped_before(done)
                if done and not dry_run and not passed_over:
                    await consumer.commit({tp: batch[done - 1].offset + 1})
                if done < len(batch):  # stopped at a record that cannot go back
                    break
                if len(batch) < len(chosen.records):  # the limit was reached
                    break
    finally:
        await consumer.stop()
        await publisher.stop()
    return report


async def _partitions(consumer: Any, topic: str) -> set[int]:
    topics = await consumer.topics()
    if topic not in topics:
        raise ConfigurationError(f"no dead-letter topic {topic!r}")
    return set(consumer.partitions_for_topic(topic) or ())


class _Chosen:
    """A fetched batch as the selection sees it: each record's letter, whether the
    selection takes it and whether it has a record; cut at the limit's last one."""

    def __init__(
        self, engine: Engine, tables: Tables, selection: Selection, left: int | None
    ) -> None:
        self.engine, self.tables, self.selection, self.left = engine, tables, selection, left
        self.records: list[Any] = []
        self.letters: list[DeadLetter] = []
        self.judged: list[tuple[bool, bool]] = []

    def cut(self, batch: Sequence[Any], id_header: str) -> list[Any]:
        """``batch`` up to the record that fills the limit (the selection's picks count)."""
        self.records = list(batch)
        letters = [_letter(record, id_header) for record in batch]
        judged = judge(self.engine, self.tables, letters, self.selection)
        end = len(batch)
        if self.left is not None:
            picks = [i for i, (chosen, _) in enumerate(judged) if chosen]
            if len(picks) >= self.left:
                end = picks[self.left - 1] + 1
        self.letters, self.judged = letters[:end], judged[:end]
        return self.records[:end]

    def skipped_before(self, done: int) -> bool:
        return not all(chosen for chosen, _ in self.judged[:done])


async def _replay_batch(
    engine: Engine,
    tables: Tables,
    publisher: Any,
    chosen: _Chosen,
    target: tuple[str | None, set[str]],
    dry_run: bool,
    on_confirmed: Callable[[DeadLetter], Any] | None,
    report: ReplayReport,
) -> int:
    """Forget, then re-produce the chosen letters up to the first one that cannot go back;
    how many records were dealt with (re-produced or passed over)."""
    to, known = target
    go = 0
    for letter, (taken, recorded) in zip(chosen.letters, chosen.judged, strict=True):
        if not taken:
            go += 1
            continue
        why = _unreplayable(letter, to, known)
        if why is None and chosen.selection.only_recorded and not recorded:
            why = UNRECORDED
        if why is not None:
            report.kept.append((letter, why))
            break
        go += 1
    going = [
        (letter, recorded)
        for letter, (taken, recorded) in zip(chosen.letters[:go], chosen.judged[:go], strict=True)
        if taken
    ]
    report.skipped += go - len(going)
    by_consumer: dict[str, list[str]] = {}
    for letter, _ in going:
        by_consumer.setdefault(str(letter.consumer), []).append(str(letter.message_id))
    for consumer, ids in by_consumer.items():
        report.forgotten += len(forget(engine, consumer, ids, dry_run=dry_run, tables=tables))
    picked = iter(going)
    for record, (taken, _) in zip(chosen.records[:go], chosen.judged[:go], strict=True):
        if not taken:
            continue
        letter, recorded = next(picked)
        if not dry_run:
            headers = [
                (k, v)
                for k, v in record.headers
                if not k.startswith(_OURS_PREFIX) and k != REPLAYED_HEADER
            ]
            where = f"{record.topic}:{record.partition}:{record.offset}"
            headers.append((REPLAYED_HEADER, where.encode()))
            await publisher.send(
                to or str(letter.source), record.value, key=record.key, headers=headers
            )
            if on_confirmed is not None:
                on_confirmed(letter)
        report.replayed.append(letter)
        if not recorded:
            report.unrecorded.append(letter)
    return go


def _letter(record: Any, id_header: str) -> DeadLetter:
    headers = {k: v.decode("utf-8", errors="replace") for k, v in record.headers if v is not None}
    return DeadLetter(
        consumer=headers.get(CONSUMER_HEADER),
        message_id=headers.get(id_header),
        source=headers.get(SOURCE_HEADER),
        reason=headers.get(REASON_HEADER),
    )


def _unreplayable(letter: DeadLetter, to: str | None, known: set[str]) -> str | None:
    if not to and not letter.source:
        return f"no {SOURCE_HEADER} header: pass --to TOPIC"
    if (topic := to or str(letter.source)) not in known:
        return f"no topic {topic!r} to return to: create it (or pass --to TOPIC)"
    if letter.consumer is None:
        return f"no {CONSUMER_HEADER} header: its record cannot be forgotten"
    if letter.message_id is None:
        return (
            "no id header: its copy would get a new id (its coordinates), so a replay "
            "repeated after a kill could apply it twice; replay it by hand"
        )
    return None
