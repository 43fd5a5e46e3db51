"""Acknowledging on Kafka: committing a partition's offset, seeking back, and telling lag 0.

An offset is committed only after the database commit of everything before it; a commit
that fails (typically a rebalance that gave the partition away) commits nothing: the new
owner reads from the last commit and the dedup table answers the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import IllegalStateError, KafkaError  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError
from consumerdedup.reasons import describe

logger = logging.getLogger("consumerdedup.kafka")


COMMIT_CHECK = 5.0
"""Seconds an offset commit may take before the runner asks whether its topic still exists:
aiokafka retries a retriable refusal (UnknownTopicOrPartition for a deleted topic) forever."""


async def commit(consumer: Any, tp: Any, offset: int) -> bool:
    """Commit ``tp`` at ``offset``; False (logged) if the broker did not take it.

    Raises ConfigurationError if the topic was deleted meanwhile: the commit would be
    retried forever, and ``stop()`` never heard."""
    attempt = asyncio.ensure_future(consumer.commit({tp: offset}))
    try:
        while not (await asyncio.wait({attempt}, timeout=COMMIT_CHECK))[0]:
            if tp.topic not in await consumer.topics():
                raise ConfigurationError(
                    f"the topic {tp.topic!r} no longer exists (deleted while the runner ran?): "
                    f"its offset {offset} cannot be committed; what is recorded is not acked and "
                    "will be answered DUPLICATE. Create the topic again (or stop consuming it), "
                    "then restart the runner"
                )
        attempt.result()
        return True
    except KafkaError as exc:
        logger.warning("offset commit of %s at %d failed: %s", tp, offset, describe(exc))
        return False
    finally:
        attempt.cancel()  # still retrying (the topic gone, or this coroutine cancelled)


def seek(consumer: Any, tp: Any, offset: int) -> None:
    """Read ``tp`` again from ``offset``, if it is still assigned."""
    if tp in consumer.assignment():
        consumer.seek(tp, offset)


async def read_again(consumer: Any, tp: Any, first: int) -> None:
    """Records from ``first`` on were fetched but not handled (a rebalance made them stale):
    put ``tp``, if it is still ours, back at the group's committed offset (all before it is
    recorded), or at ``first`` when nothing is committed. Read twice is answered DUPLICATE;
    left behind would be skipped by the next chunk's commit."""
    if tp not in consumer.assignment():
        return  # its new owner reads from the committed offset
    try:
        committed = await consumer.committed(tp)
    except KafkaError as exc:  # not answered: ``first`` is known without the broker
        logger.info("committed offset of %s not read (%s); from %d", tp, describe(exc), first)
        committed = None
    # Given away meanwhile (IllegalStateError): its new owner reads from the committed offset.
    with contextlib.suppress(IllegalStateError):
        consumer.seek(tp, first if committed is None else committed)


async def drained(consumer: Any, topics: Sequence[str]) -> bool:
    """The group's committed offsets reach the end of every partition of ``topics``, as this
    member can tell: for a partition it owns, the end its fetches saw; for another's, the end
    the broker lists.

    False, not an error, when the assignment changed during the check (a rebalance during one
    of its awaits): a partition given away is no longer ours to judge, and one given to us was
    judged as another's, without the records its fetches will see."""
    partitions = [tp for topic in topics for tp in _partitions(consumer, topic)]
    if not partitions:
        return False
    assigned = consumer.assignment()
    ends = await consumer.end_offsets(partitions)
    for tp in partitions:
        end = ends[tp]
        if tp in assigned:
            if consumer.assignment() != assigned:
                return False  # given away since (highwater() would fail an assertion)
            # The high watermark of the last fetch: some brokers (Tansu 0.6) answer
            # ListOffsets with the start of the last record batch plus one.
            seen = consumer.highwater(tp)
            if seen is None:
                return False  # not fetched yet since the assignment
            end = max(end, seen)
        if ((await consumer.committed(tp)) or 0) < end:
            return False
    return bool(consumer.assignment() == assigned)


def _partitions(consumer: Any, topic: str) -> list[Any]:
    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
