"""The dead-letter path: a FAILED record's copy, with its reason, to the dead-letter topic.

A copy the broker refuses for good (too large, no right to the topic) must not hold the
partition, so a copy without the value goes, then a bare one (no value, no key, no original
header but the id: any of them may be what is too large); if that is refused too the loss is
logged at ERROR and the FAILED record is kept. A failure that may pass (the broker away, no
topic yet) holds the partition at that record: it is read again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from consumerdedup import MAX_ID_LENGTH, Outcome, Result
from consumerdedup.reasons import REASON_LIMIT, describe

from .config import KafkaConfig
from .convert import BODY_DROPPED_HEADER, OUR_HEADERS, coordinates, dead_letter_headers
from .errors import PublishFailed, PublishRefused
from .publisher import KafkaPublisher

logger = logging.getLogger("consumerdedup.kafka")


class DeadLetters:
    """Sends a consumer's FAILED records to their dead-letter topics through ``publisher``."""

    def __init__(self, publisher: KafkaPublisher, config: KafkaConfig, consumer: str) -> None:
        self.publisher = publisher
        self.config = config
        self.consumer = consumer

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
                refused.append(describe(exc))
                continue
            except PublishFailed as exc:
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

    def _bare(self, headers: Sequence[Any], dropped: tuple[str, bytes]) -> list[Any]:
        """Our headers and the id (when it can be one) of a dead letter, without the rest."""
        kept = [
            (name, value)
            for name, value in headers
            if name in OUR_HEADERS
            or (name == self.config.id_header and len(value) <= MAX_ID_LENGTH)
        ]
        return [*kept, dropped]
