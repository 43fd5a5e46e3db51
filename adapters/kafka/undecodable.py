"""Records aiokafka cannot decode (a header key that is not UTF-8): found, refused, passed.

aiokafka decodes a record batch one record at a time inside ``getmany``; a header key that is
not UTF-8 raises UnicodeDecodeError out of it, for the whole fetch. The records it had drained
of other partitions are then gone (their positions moved on), and every later fetch of that
partition raises again: the runner would stop there for good. So the runner rewinds every
partition to where it stands, reads each alone, one record at a time, up to the first record
that cannot be decoded, and refuses the range aiokafka cannot read (that record, and the rest
of its batch: the decoder cannot step over it) with the reason; the partition goes on after it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError  # type: ignore[import-untyped]

from consumerdedup.reasons import describe

logger = logging.getLogger("consumerdedup.kafka")
UNDECODABLE = (UnicodeDecodeError,)
"""What aiokafka raises out of ``getmany`` for a record it cannot decode."""


@dataclass(frozen=True)
class Undecodable:
    """Stands for a record aiokafka cannot decode: where it is, and why it is refused."""

    topic: str
    partition: int
    offset: int
    reason: str
    key: None = None
    value: None = None
    timestamp: int = -1
    headers: tuple[Any, ...] = field(default=())


async def rewind(consumer: Any, positions: Mapping[Any, int], reset: str) -> None:
    """Every assigned partition back to where the runner stands on it: what it handled last
    (``positions``), else the group's commit, else the start when ``reset`` is "earliest".
    One given away meanwhile is left to its new owner (it reads from the group's commit)."""
    for tp in consumer.assignment():
        offset = positions.get(tp)
        if offset is None:
            offset = await consumer.committed(tp)
        if tp not in consumer.assignment():
            continue  # given away during the await
        if offset is not None:
            consumer.seek(tp, offset)
        elif reset == "earliest":
            await consumer.seek_to_beginning(tp)


async def read_alone(
    consumer: Any, tp: Any, size: int, wait_ms: int, stopping: Callable[[], bool]
) -> tuple[list[Any], list[Undecodable]]:
    """Up to ``size`` records of ``tp`` as fetched, one at a time (so a decoding error comes at
    the record that raised it), and the Undecodable range that stopped them, if any."""
    records: list[Any] = []
    timeout = wait_ms
    while len(records) < size:
        try:
            got = await consumer.getmany(tp, timeout_ms=timeout, max_records=1)
        except UNDECODABLE as exc:
            if tp not in consumer.assignment():
                return records, []  # given away meanwhile: its new owner finds the record
            start = await consumer.position(tp)  # just after the last record returned
            return records, await _range(consumer, tp, start, exc, wait_ms, stopping)
        if not got:
            break
        records.extend(got.get(tp, []))
        timeout = 0  # the rest of what was fetched, not a wait for more
    return records, []


async def _range(
    consumer: Any, tp: Any, start: int, exc: Exception, wait_ms: int, stopping: Callable[[], bool]
) -> list[Undecodable]:
    """The offsets from ``start`` up to the first one aiokafka can read from again (the end of
    the undecodable record's batch, or of the log); the partition is left there. Nothing if the
    partition was given away meanwhile: not ours to refuse, its new owner finds the range."""
    try:
        listed = (await consumer.end_offsets([tp]))[tp]
    except KafkaError:  # the fetch's high watermark says it too
        listed = 0
    if tp not in consumer.assignment():
        return []  # given away during the await (highwater() would fail an assertion)
    end = max(listed, consumer.highwater(tp) or 0, start + 1)
    offset = start + 1
    while offset < end and not stopping():
        if tp not in consumer.assignment():
            return []  # given away during a getmany
        consumer.seek(tp, offset)
        try:
            got = await consumer.getmany(tp, timeout_ms=wait_ms, max_records=1)
        except UNDECODABLE:
            offset += 1  # still inside a batch aiokafka cannot read
            continue
        if got:
            break  # readable from here
    if tp not in consumer.assignment():
        return []
    consumer.seek(tp, offset)
    cause = f"aiokafka cannot decode it ({describe(exc)}; a header key that is not UTF-8?)"
    logger.error(
        "%s:%d: records %d..%d cannot be decoded (%s): refused, the partition goes on",
        tp.topic,
        tp.partition,
        start,
        offset - 1,
        describe(exc),
    )
    first = Undecodable(tp.topic, tp.partition, start, f"the record cannot be read: {cause}")
    rest = [
        Undecodable(
            tp.topic,
            tp.partition,
            at,
            f"the record cannot be read: it is in the batch of the record at offset {start}, "
            "which aiokafka cannot decode, and cannot be read past it",
        )
        for at in range(start + 1, offset)
    ]
    return [first, *rest]
