"""KafkaConsumerRunner: records -> Messages -> handler.process_batch -> dead letters -> offsets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka.errors import IllegalStateError, KafkaError  # type: ignore[import-untyped]

from consumerdedup import ConfigurationError, Outcome, Result
from consumerdedup.dedup.processing import AsyncProcessor, Handler
from consumerdedup.lifecycle import BeforeAck, ConsumerRunner

from . import acks, connection, undecodable
from .config import DEFAULT_BOOTSTRAP, KafkaConfig
from .convert import to_message
from .dead_letters import DeadLetters
from .publisher import KafkaPublisher
from .retry_later import RetrySchedule
from .subscription import InFlight, RebalanceListener, all_of, in_flight_limit

logger = logging.getLogger("consumerdedup.kafka")


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
    - The partitions of one fetch are handled concurrently, up to
      ``partitions_in_flight`` chunks at once (each its own transaction and
      database connection), each partition's chunks one after another.
    - A rebalance waits for the chunks in flight to finish and commit; records
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
        self._in_flight = InFlight()  # the chunks a revocation waits for
        self._width = 1  # chunks in flight at most, set by run() from the handler's engine
        self._schedule = RetrySchedule(self.config.redelivery_backoff)
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
        listener = RebalanceListener(
            lambda tps: self._revoked(tps), lambda tps: self._in_flight.assigned()
        )
        consumer.subscribe(list(self.topics), listener=listener)
        publisher = KafkaPublisher(
            self.bootstrap_servers,
            enable_idempotence=cfg.idempotent_producer,
            options=cfg.producer_options,
        )
        dead_letters = DeadLetters(publisher, cfg, self.processor.consumer)
        self._schedule.paused.clear()
        self._positions.clear()
        self._in_flight = InFlight()  # bound to this run's event loop
        self._width = in_flight_limit(self.handler.dedup.engine, cfg.partitions_in_flight)
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
            await publisher.start()
            await self._consume(consumer, dead_letters, until_idle)
        finally:
            self.consumer = None
            # Auto-commit is off: closing commits nothing, whatever ended the loop.
            await consumer.stop()
            await publisher.stop()

    async def _consume(self, consumer: Any, dead_letters: DeadLetters, until_idle: bool) -> None:
        schedule = self._schedule
        poll = self.config.poll_timeout.total_seconds()
        while not self.stopping:
            schedule.resume_due(consumer)
            # Taken before the fetch: a revocation during one of its getmany calls makes what
            # the calls before it returned stale.
            epoch = self._in_flight.epoch
            try:
                fetched = await self._fetch(consumer, schedule.wait_ms(poll))
            except undecodable.UNDECODABLE:
                try:
                    await self._read_alone(consumer, dead_letters)
                except IllegalStateError:  # a rebalance took a partition meanwhile: read anew
                    logger.info("a rebalance came while reading partitions alone; reading on")
                continue
            if not fetched:
                if until_idle and not schedule.paused and await self._idle(consumer):
                    return
                continue
            await self._handle_fetch(consumer, dead_letters, fetched, epoch)

    async def _idle(self, consumer: Any) -> bool:
        """Lag 0 as this member can tell, and no rebalance under way or come meanwhile: a
        partition given away is not ours to judge, and one given to us must be read first."""
        epoch = self._in_flight.epoch
        if self._in_flight.rebalancing:
            return False
        return await acks.drained(consumer, self.topics) and epoch == self._in_flight.epoch

    async def _fetch(self, consumer: Any, wait_ms: int) -> dict[Any, list[Any]]:
        """Up to batch_size records of each partition that has some: the first getmany waits
        for any, the others take what the fetcher holds already. One getmany for all would
        fill its max_records from one partition before the next, and leave nothing to handle
        beside it."""
        size = self.config.batch_size
        fetched: dict[Any, list[Any]] = await consumer.getmany(timeout_ms=wait_ms, max_records=size)
        if fetched:
            for tp in consumer.assignment() - fetched.keys() - consumer.paused():
                fetched.update(await consumer.getmany(tp, timeout_ms=0, max_records=size))
        return fetched

    async def _handle_fetch(
        self,
        consumer: Any,
        dead_letters: DeadLetters,
        fetched: dict[Any, list[Any]],
        epoch: int,
    ) -> None:
        size = self.config.batch_size
        slots = asyncio.Semaphore(self._width)  # FIFO: the partitions take turns

        async def partition(tp: Any, records: list[Any]) -> None:
            for start in range(0, len(records), size):
                async with slots:
                    if self.stopping:
                        return  # nothing committed past what is recorded: read again at start
                    if not self._in_flight.begin(epoch):
                        # A rebalance made the rest of this fetch stale, but the consumer's
                        # position moved past it: read it again, or a later chunk's commit
                        # would skip it.
                        await acks.read_again(consumer, tp, records[start].offset)
                        return
                    try:
                        chunk = records[start : start + size]
                        handled = await self._handle(consumer, dead_letters, tp, chunk)
                    finally:
                        self._in_flight.end()
                if not handled:
                    return  # the partition was sent back to a record: the rest comes again

        await all_of([partition(tp, records) for tp, records in fetched.items()])

    async def _read_alone(self, consumer: Any, dead_letters: DeadLetters) -> None:
        """A record of some partition cannot be decoded (see ``undecodable``): every partition
        back to where it stands, then each read alone up to it; the undecodable range is
        refused like any unreadable record, and its partition goes on after it."""
        reset = self.config.consumer_options.get("auto_offset_reset", "earliest")
        await undecodable.rewind(consumer, self._positions, reset)
        epoch, wait = self._in_flight.epoch, int(self.config.poll_timeout.total_seconds() * 1000)
        for tp in sorted(consumer.assignment() - set(self._schedule.paused), key=str):
            found, refused = await undecodable.read_alone(
                consumer, tp, self.config.batch_size, wait, lambda: self.stopping
            )
            if self.stopping:
                return
            if not self._in_flight.begin(epoch):
                if found or refused:  # stale, and the position is past them: read them again
                    await acks.read_again(consumer, tp, (found or refused)[0].offset)
                return
            try:
                if found and not await self._handle(consumer, dead_letters, tp, found):
                    continue  # sought back: the range comes again after them
                if refused:
                    await self._handle(consumer, dead_letters, tp, refused)
            finally:
                self._in_flight.end()

    async def _handle(
        self, consumer: Any, dead_letters: DeadLetters, tp: Any, records: Sequence[Any]
    ) -> bool:
        """One transaction, its dead letters, its offset commit; False if it sought back."""
        results = await self._process(records)
        self.committed(results)  # the before_ack hook: a SimulatedCrash leaves from here
        done = next((i for i, r in enumerate(results) if r.outcome is Outcome.RETRY), len(results))
        done = await dead_letters.send_failed(records[:done], results[:done])
        self._schedule.settled(records[:done])
        if done and not await acks.commit(consumer, tp, records[done - 1].offset + 1):
            acks.seek(consumer, tp, records[0].offset)  # read again: answered DUPLICATE
            self._positions[tp] = records[0].offset
            return False
        if done < len(records):
            self._schedule.retry(consumer, tp, records[done], results[done])
            self._positions[tp] = records[done].offset
            return False
        self._positions[tp] = records[-1].offset + 1
        return True

    async def _process(self, records: Sequence[Any]) -> list[Result]:
        # A chunk is one partition's records in offset order: nothing commits behind a retry.
        delivered = [to_message(record, self.config) for record in records]
        return await self.processor.process(delivered, ordered=True)

    async def _revoked(self, revoked: Any) -> None:
        await self._in_flight.revoke()  # the chunks in flight finish and commit first
        for tp in revoked:
            self._schedule.forget(tp)
            self._positions.pop(tp, None)
