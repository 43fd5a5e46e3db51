"""The dead-letter path: a FAILED record's copy, with its reason, to the dead-letter topic.

A copy the broker refuses for good (too large, no right to the topic) must not hold the
partition, so a copy without the value goes, then a bare one (no value, no key, no original
header but the id: any of them may be what is too large); if that is refused too the loss is
logged at ERROR and the FAILED record is kept. A failure that may pass (the broker away, a
retriable error) holds the partition at that record: it is read again.

A dead-letter topic the broker does not have and will not create (auto-create off, no right
to create it, a name it refuses) is a setup fault: DeadLetterMissing stops the runner, the
record's offset uncommitted. Before the first dead letter to a topic the broker is asked
about it (a metadata request that creates it where a send would): handed to the producer
instead, such a topic made aiokafka wait ``request_timeout_ms`` (40 s) per send, logging
an ERROR line every 100 ms, and the partition was read again from that record forever.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import errors as kafka_errors  # type: ignore[import-untyped]

from consumerdedup import MAX_ID_LENGTH, Outcome, Result
from consumerdedup.reasons import REASON_LIMIT, describe

from .config import KafkaConfig
from .convert import BODY_DROPPED_HEADER, OUR_HEADERS, coordinates, dead_letter_headers
from .errors import DeadLetterMissing, PublishFailed, PublishRefused, TopicMissing, TopicRefused
from .publish_failures import topic_answer
from .publisher import KafkaPublisher

logger = logging.getLogger("consumerdedup.kafka")

MISSING_ASKS = 3
"""Answers "no such topic" in a row, ASK_PAUSE apart, before the topic is called missing:
a broker may not know yet of a topic created a moment ago on another."""
ASK_PAUSE = 0.5
_NOT_OURS_TO_WRITE = kafka_errors.TopicAuthorizationFailedError
"""A refusal of every copy (round 3's rule: logged, the FAILED record kept), not a fault."""


class DeadLetters:
    """Sends a consumer's FAILED records to their dead-letter topics through ``publisher``."""

    def __init__(self, publisher: KafkaPublisher, config: KafkaConfig, consumer: str) -> None:
        self.publisher = publisher
        self.config = config
        self.consumer = consumer
        self._usable: set[str] = set()  # dead-letter topics the broker has

    async def send_failed(self, records: Sequence[Any], results: Sequence[Result]) -> int:
        """Send the FAILED ones, in order; how many records lead up to the first unsent one."""
        for index, (record, result) in enumerate(zip(records, results, strict=True)):
            failed = result.outcome is Outcome.FAILED
            if failed and not await self.send(record, result.reason):
                return index
        return len(records)

    async def send(self, record: Any, reason: str | None) -> bool:
        """True once the copy is sent, or can never be (see the module's docstring); False
        for a failure that may pass."""
        topic = self.config.dead_letters_of(record.topic)
        headers = dead_letter_headers(record, reason or "failed", self.consumer)
        where = f"{coordinates(record)} to {topic}"
        # A null value goes as empty: aiokafka refuses a record with neither key nor value.
        value = record.value if isinstance(record.value, bytes) else b""
        if topic not in self._usable:
            await self._check(topic, coordinates(record))
        refused: list[str] = []
        for copy in range(3):
            if copy:
                dropped = (BODY_DROPPED_HEADER, refused[0][:REASON_LIMIT].encode())
                headers = [*headers, dropped] if copy == 1 else self._bare(headers, dropped)
                value = b""
            try:
                await self.publisher.send(
                    topic, value, key=record.key if copy < 2 else None, headers=headers
                )
            except PublishRefused as exc:
                if isinstance(exc, TopicRefused):  # the topic, not this copy: a setup fault
                    await self._check(topic, coordinates(record))
                refused.append(describe(exc))
                continue
            except PublishFailed as exc:
                if isinstance(exc, TopicMissing):  # deleted since it was checked?
                    self._usable.discard(topic)
                    await self._check(topic, coordinates(record))
                logger.error(
                    "cannot dead-letter %s, it will be read again: %s", where, describe(exc)
                )
                return False
            if refused:
                logger.error(
                    "dead-lettered %s without its value%s, which was refused: %s",
                    where,
                    "" if copy == 1 else ", key and headers",
                    refused[0],
                )
            return True
        logger.error(
            "cannot dead-letter %s, not even without its value, key and headers (%s): it is "
            "not dead-lettered, its FAILED record is kept",
            where,
            "; then ".join(refused),
        )
        return True

    async def _check(self, topic: str, record_at: str) -> None:
        """Raise DeadLetterMissing if the broker does not have ``topic`` and will not create
        it; remember it as usable once it has it. Any other answer, or none, is left to the
        send to tell (an authorization refusal is a refused copy, see the module docstring)."""
        answer = await topic_answer(self.publisher.client, topic)
        for _ in range(MISSING_ASKS - 1):
            if answer is not kafka_errors.UnknownTopicOrPartitionError:
                break
            await asyncio.sleep(ASK_PAUSE)
            answer = await topic_answer(self.publisher.client, topic)
        if answer is kafka_errors.NoError:
            self._usable.add(topic)
            return
        if answer is kafka_errors.UnknownTopicOrPartitionError:
            raise DeadLetterMissing(
                f"the dead-letter topic {topic!r} does not exist and the broker does not create "
                "it (auto.create.topics.enable off, or no right to create topics): create it "
                "(one partition if dead-letter order matters), or set "
                f"KafkaConfig(dead_letter_topic=...) to a topic that exists, then restart the "
                f"runner. {record_at} is recorded FAILED and not acked: it is read again and "
                "dead-lettered then"
            )
        if answer is None or answer.retriable or answer is _NOT_OURS_TO_WRITE:
            return
        raise DeadLetterMissing(
            f"the broker refuses the dead-letter topic {topic!r} ({answer.__name__}: "
            f"{answer.description}): set KafkaConfig(dead_letter_topic=...) to a name Kafka "
            "accepts ([a-zA-Z0-9._-], at most 249 characters, not '.' or '..') and the broker "
            f"allows, then restart the runner. {record_at} is recorded FAILED and not acked: it is "
            "read again and dead-lettered then"
        )

    def _bare(self, headers: Sequence[Any], dropped: tuple[str, bytes]) -> list[Any]:
        """Our headers and the id (when it can be one) of a dead letter, without the rest."""
        kept = [
            (name, value)
            for name, value in headers
            if name in OUR_HEADERS
            or (name == self.config.id_header and len(value) <= MAX_ID_LENGTH)
        ]
        return [*kept, dropped]
