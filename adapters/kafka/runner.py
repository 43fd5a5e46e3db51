"""KafkaConsumerRunner: records -> Messages -> handler.process_batch -> dead letters -> offsets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition  # type: ignore[import-untyped]
from aiokafka.errors import IllegalStateError, KafkaError  # type: ignore[import-untyped]

from consumerdedup import MAX_ID_LENGTH, ConfigurationError, Outcome, Result
from consumerdedup.dedup.processing import AsyncProcessor, Handler
from consumerdedup.headers import CONSUMER_HEADER, REASON_HEADER, SOURCE_HEADER
from consumerdedup.lifecycle import BeforeAck, ConsumerRunner
from consumerdedup.reasons import REASON_LIMIT, describe

from . import connection, undecodable
from .config import DEFAULT_BOOTSTRAP, KafkaConfig
from .convert import (
    BODY_DROPPED_HEADER,
    OFFSET_HEADER,
    PARTITION_HEADER,
    coordinates,
    dead_letter_headers,
    to_message,
)
from .errors import PublishFailed, PublishRefused
from .publisher import KafkaPublisher

logger = logging.getLogger("consumerdedup.kafka")
_RETRY_MEMORY = 10_000


class KafkaConsumerRunner(ConsumerRunner):
    """Consume ``topics`` as group ``group_id`` (default: the dedup consumer name).

    - Each partition is handled in offset order, in chunks of at most
      ``batch_size`` records; a chunk is one ``process_batch`` call, so one
      database transaction.
    - After that commit: FAILED records are sent to the dead-letter topic and
      acknowledged by the broker; then the partition's offset is committed up
      to the first RETRY record (or the first dead letter that could not be
      sent), never past it; the partition pauses for ``retry_delay`` (doubled per RETRY of
      the same record in a row, up to ``max_retry_delay``) and is
      re-read from that record. Nothing behind a RETRY record commits before
      it: the records behind it are RETRY too, and come again after it.
    - A rebalance waits for the batch in flight to finish and commit; records
      fetched before it and not yet handled are dropped, the new owner reads
      them from the committed offset.
    - Auto-commit is off, so a crash, a cancel or a SimulatedCrash commits
      nothing more: what was not committed is delivered again, and the
      dedup table answers DUPLICATE for what the database already has.
    """

    def __init__(
        self,
        handler: Handler,
        topics: str | Sequence[str],
        *,
        bootstrap_servers: str | Sequence[str] = DEFAULT_BOOTSTRAP,
        group_id: str | None = None,
        config: KafkaConfig | None = None,
        before_ack: BeforeAck | None = None,
    ) -> None:
        super().__init__(before_ack=before_ack)
        self.processor = AsyncProcessor(handler)
        self.topics = (topics,) if isinstance(topics, str) else tuple(topics)
        if not self.topics or not all(isinstance(t, str) and t for t in self.topics):
            raise ConfigurationError("topics must be a topic name or a non-empty list of them")
        self.config = config if config is not None else KafkaConfig()
        if any(self.config.dead_letters_of(t) in self.topics for t in self.topics):
            raise ConfigurationError("a dead-letter topic must not be one of the consumed topics")
        self.config.check_dead_letters(self.topics)
        connection.check_bootstrap(bootstrap_servers)
        self.handler = handler
        self.bootstrap_servers = bootstrap_servers
        self.group_id = group_id or self.processor.consumer
        self.consumer: Any = None
        """The AIOKafkaConsumer while ``run()`` runs."""
        self._epoch = 0  # bumped by each revocation: fetched records from before are stale
        self._lock = asyncio.Lock()  # held by the batch in flight; a revocation waits on it
        self._paused: dict[Any, float] = {}  # partition -> loop time to resume it
        self._retries: dict[str, int] = {}  # RETRYs in a row per record, for the backoff
        self._positions: dict[Any, int] = {}  # partition -> offset the runner reads from next

    async def run(self, *, until_idle: bool = False) -> None:
        """Consume until ``stop()`` (or a signal after ``on_signals()``), then close.

        ``until_idle``: also return once the group's committed offsets reach
        the end of every partition of the topics (lag 0) and no partition
        waits to retry; for tests, back-fills and benchmarks.
        """
        if self.consumer is not None:
            raise RuntimeError("this runner is already running")
        await self.processor.check_startup()  # a missing table or right stops it here
        cfg = self.config
        consumer = connection.consumer(self.bootstrap_servers, self.group_id, cfg.consumer_options)
        consumer.subscribe(list(self.topics), listener=_Listener(self))
        dead_letters = KafkaPublisher(
            self.bootstrap_servers,
            enable_idempotence=cfg.idempotent_producer,
            options=cfg.producer_options,
        )
        self._paused.clear()
        self._positions.clear()
        self._lock = asyncio.Lock()  # bound to this run's event loop
        self.consumer = consumer
        try:
            try:
                await consumer.start()
            except KafkaError as exc:  # refused credentials are fatal: retrying cannot fix them
                where, options = self.bootstrap_servers, cfg.consumer_options
                sasl = exc if isinstance(exc, connection.SASL_FAILURES) else None
                if sasl or (sasl := await connection.sasl_refusal(where, options)):
                    raise connection.authentication_failed(sasl, where) from exc
                raise
            # Now, not at the first dead letter: a producer the broker will not start (an
            # idempotent one on Tansu) is a setup fault (BrokerRefused, a ConfigurationError
            # naming idempotent_producer=False), said before any record is read.
            await dead_letters.start()
            await self._consume(consumer, dead_letters, until_idle)
        finally:
            self.consumer = None
            # Auto-commit is off: closing commits nothing, whatever ended the loop.
            await consumer.stop()
            await dead_letters.stop()

    async def _consume(self, consumer: Any, dead_letters: KafkaPublisher, until_idle: bool) -> None:
        size = self.config.batch_size
        while not self.stopping:
            self._resume_due(consumer)
            # Up to batch_size records per assigned partition; each partition's share is then
            # handled in chunks of batch_size.
            try:
                fetched = await consumer.getmany(
                    timeout_ms=self._wait_ms(),
                    max_records=size * max(1, len(consumer.assignment())),
                )
            except undecodable.UNDECODABLE:
                try:
                    await self._read_alone(consumer, dead_letters)
                except IllegalStateError:  # a rebalance took a partition meanwhile: read anew
                    logger.info("a rebalance came while reading partitions alone; reading on")
                continue
            if not fetched:
                if until_idle and not self._paused and await self._drained(consumer):
                    return
                continue
            await self._handle_fetch(consumer, dead_letters, fetched)

    async def _handle_fetch(
        self, consumer: Any, dead_letters: KafkaPublisher, fetched: dict[Any, list[Any]]
    ) -> None:
        epoch, size = self._epoch, self.config.batch_size
        for tp, records in fetched.items():
            for start in range(0, len(records), size):
                async with self._lock:
                    if self.stopping or epoch != self._epoch:
                        return  # stop asked, or a rebalance made the rest of this fetch stale
                    chunk = records[start : start + size]
                    if not await self._handle(consumer, dead_letters, tp, chunk):
                        break  # the partition was sent back to a record: the rest comes again

    async def _read_alone(self, consumer: Any, dead_letters: KafkaPublisher) -> None:
        """A record of some partition cannot be decoded (see ``undecodable``): every partition
        back to where it stands, then each read alone up to it; the undecodable range is
        refused like any unreadable record, and its partition goes on after it."""
        reset = self.config.consumer_options.get("auto_offset_reset", "earliest")
        await undecodable.rewind(consumer, self._positions, reset)
        epoch, wait = self._epoch, int(self.config.poll_timeout.total_seconds() * 1000)
        for tp in sorted(consumer.assignment() - set(self._paused), key=str):
            found, refused = await undecodable.read_alone(
                consumer, tp, self.config.batch_size, wait, lambda: self.stopping
            )
            async with self._lock:
                if self.stopping or epoch != self._epoch:
                    return
                if found and not await self._handle(consumer, dead_letters, tp, found):
                    continue  # sought back: the range comes again after them
                if refused:
                    await self._handle(consumer, dead_letters, tp, refused)

    async def _handle(
        self, consumer: Any, dead_letters: KafkaPublisher, tp: Any, records: Sequence[Any]
    ) -> bool:
        """One transaction, its dead letters, its offset commit; False if it sought back."""
        results = await self._process(records)
        self.committed(results)  # the before_ack hook: a SimulatedCrash leaves from here
        done = next((i for i, r in enumerate(results) if r.outcome is Outcome.RETRY), len(results))
        done = await self._dead_letter(dead_letters, records[:done], results[:done])
        for record in records[:done]:
            self._retries.pop(coordinates(record), None)
        if done and not await self._commit(consumer, tp, records[done - 1].offset + 1):
            self._seek(consumer, tp, records[0].offset)  # read again: answered DUPLICATE
            self._positions[tp] = records[0].offset
            return False
        if done < len(records):
            self._retry_later(consumer, tp, records[done], results[done])
            self._positions[tp] = records[done].offset
            return False
        self._positions[tp] = records[-1].offset + 1
        return True

    async def _process(self, records: Sequence[Any]) -> list[Result]:
        # A chunk is one partition's records in offset order: nothing commits behind a retry.
        delivered = [to_message(record, self.config) for record in records]
        return await self.processor.process(delivered, ordered=True)

    async def _dead_letter(
        self, dead_letters: KafkaPublisher, records: Sequence[Any], results: Sequence[Result]
    ) -> int:
        """Send the FAILED ones, in order; how many records lead up to the first unsent one."""
        for index, (record, result) in enumerate(zip(records, results, strict=True)):
            failed = result.outcome is Outcome.FAILED
            if failed and not await self._send_dead_letter(dead_letters, record, result.reason):
                return index
        return len(records)

    async def _send_dead_letter(
        self, dead_letters: KafkaPublisher, record: Any, reason: str | None
    ) -> bool:
        """True once the copy is sent, or can never be: a refusal for good (too large, no
        right to the topic) must not hold the partition, so a copy without the value goes,
        then a bare one (no value, no key, no original header but the id: any of them may be
        what is too large); if that is refused too the loss is logged at ERROR (the FAILED
        record is kept). False for a failure that may pass (the broker away, no topic yet)."""
        topic = self.config.dead_letters_of(record.topic)
        headers = dead_letter_headers(record, reason or "failed", self.processor.consumer)
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
                await dead_letters.send(
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
        ours = {REASON_HEADER, CONSUMER_HEADER, SOURCE_HEADER, PARTITION_HEADER, OFFSET_HEADER}
        kept = [
            (name, value)
            for name, value in headers
            if name in ours or (name == self.config.id_header and len(value) <= MAX_ID_LENGTH)
        ]
        return [*kept, dropped]

    async def _commit(self, consumer: Any, tp: Any, offset: int) -> bool:
        try:
            await consumer.commit({tp: offset})
            return True
        except KafkaError as exc:
            # Typically a rebalance that gave the partition away: its new owner
            # reads from the last commit and the dedup table answers the rest.
            logger.warning("offset commit of %s at %d failed: %s", tp, offset, describe(exc))
            return False

    @staticmethod
    def _seek(consumer: Any, tp: Any, offset: int) -> None:
        if tp in consumer.assignment():
            consumer.seek(tp, offset)

    def _retry_later(self, consumer: Any, tp: Any, record: Any, result: Result) -> None:
        key = coordinates(record)
        count = self._retries[key] = self._retries.pop(key, 0) + 1
        while len(self._retries) > _RETRY_MEMORY:
            del self._retries[next(iter(self._retries))]
        delay = self.config.redelivery_backoff.delay(count)
        logger.warning(
            "%s will be read again in %.3fs: %s",
            coordinates(record),
            delay,
            result.reason or "dead letter not sent",
        )
        self._seek(consumer, tp, record.offset)
        if delay > 0 and tp in consumer.assignment():
            consumer.pause(tp)
            self._paused[tp] = asyncio.get_running_loop().time() + delay

    def _resume_due(self, consumer: Any) -> None:
        now = asyncio.get_running_loop().time()
        due = [tp for tp, at in self._paused.items() if at <= now]
        for tp in due:
            del self._paused[tp]
        assigned = consumer.assignment()
        consumer.resume(*(tp for tp in due if tp in assigned))

    def _wait_ms(self) -> int:
        wait = self.config.poll_timeout.total_seconds()
        if self._paused:
            soonest = min(self._paused.values()) - asyncio.get_running_loop().time()
            wait = max(0.0, min(wait, soonest))
        return int(wait * 1000)

    async def _drained(self, consumer: Any) -> bool:
        partitions = [tp for topic in self.topics for tp in _partitions(consumer, topic)]
        if not partitions:
            return False
        ends = await consumer.end_offsets(partitions)
        assigned = consumer.assignment()
        for tp in partitions:
            end = ends[tp]
            if tp in assigned:
                # The high watermark of the last fetch: some brokers (Tansu 0.6) answer
                # ListOffsets with the start of the last record batch plus one.
                seen = consumer.highwater(tp)
                if seen is None:
                    return False  # not fetched yet since the assignment
                end = max(end, seen)
            if ((await consumer.committed(tp)) or 0) < end:
                return False
        return True

    async def _revoked(self, revoked: Any) -> None:
        async with self._lock:  # the batch in flight finishes and commits first
            self._epoch += 1
            for tp in revoked:
                self._paused.pop(tp, None)
                self._positions.pop(tp, None)


def _partitions(consumer: Any, topic: str) -> list[Any]:
    return [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, runner: KafkaConsumerRunner) -> None:
        self.runner = runner

    async def on_partitions_revoked(self, revoked: Any) -> None:
        await self.runner._revoked(revoked)

    async def on_partitions_assigned(self, assigned: Any) -> None:
        pass
