"""KafkaConsumerRunner: records -> Messages -> handler.process_batch -> dead letters -> offsets."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

from aiokafka.errors import IllegalStateError, KafkaError  # type: ignore[import-untyped]

from consumerdedup import Outcome, Result, collector
from consumerdedup.dedup.processing import AsyncProcessor, Handler
from consumerdedup.headers import REPLAYED_HEADER
from consumerdedup.lifecycle import BeforeAck, ConsumerRunner, DeadlinePassed
from consumerdedup.options import instance, matching, maybe, names, refuse, text

from . import acks, connection, undecodable
from .config import CONSUMED_RULE, CONSUMED_TOPIC, DEFAULT_BOOTSTRAP, KafkaConfig
from .convert import to_message
from .dead_letters import DeadLetters
from .offsets import OffsetStore
from .ownership import Ownership
from .publisher import KafkaPublisher
from .retry_later import RetrySchedule
from .subscription import InFlight, RebalanceListener, all_of, in_flight_limit

logger = logging.getLogger("consumerdedup.kafka")
_CONFIG = "a KafkaConfig or None"


def _topic(name: object, option: str) -> str:
    return matching(name, option, CONSUMED_TOPIC, CONSUMED_RULE)


T = TypeVar("T")

_DEADLINE_CHECK = 0.5
"""How often run() looks for a deadline given to stop() while nothing else wakes it."""
_HELD_CHECK = 0.1
"""How often a start or a fetch the broker holds looks at the stop flag."""
DEAD_LETTER_TRIES = 3
"""Offsets in the database: sends of a chunk's dead letters before one still unsent is
logged at ERROR with its coordinates (the offset moved past it with the chunk's commit)."""


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
    - ``KafkaConfig(offsets="database")``: each chunk's transaction also writes the
      partition's next offset to consumer_offsets, fenced by the owner epoch taken at
      assignment (ownership.py); assignment seeks to it; the broker commit follows for
      lag tooling only.
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
        self._use_breaker(self.processor.breaker)
        self.topics = names(topics, "KafkaConsumerRunner.topics", each=_topic)
        config = maybe(config, "KafkaConsumerRunner.config", instance, KafkaConfig, _CONFIG)
        self.config = config if config is not None else KafkaConfig()
        maybe(group_id, "KafkaConsumerRunner.group_id", text)
        if any(self.config.dead_letters_of(t) in self.topics for t in self.topics):
            raise refuse(
                "KafkaConfig.dead_letter_topic",
                self.config.dead_letter_topic,
                f"a topic none of the consumed topics {list(self.topics)!r:.120} is",
            )
        self.config.check_dead_letters(self.topics)
        connection.check_bootstrap(bootstrap_servers)
        self.handler = handler
        self.bootstrap_servers = bootstrap_servers
        self.group_id = group_id or self.processor.consumer
        self._ownership: Ownership | None = None
        """Offsets in the database: the partitions owned, and the epoch of each."""
        if self.config.offsets == "database":
            store = OffsetStore(handler.dedup.engine, handler.dedup.tables, self.group_id)
            self._ownership = Ownership(store, self.config.claim_ids)
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
        # A missing table or right stops it here; a database away is waited for.
        if not await self.start_checked_async(self._check_startup):
            return
        cfg = self.config
        consumer = connection.consumer(self.bootstrap_servers, self.group_id, cfg.consumer_options)
        listener = RebalanceListener(
            lambda tps: self._revoked(tps), lambda tps: self._assigned(consumer, tps)
        )
        publisher = KafkaPublisher(
            self.bootstrap_servers,
            enable_idempotence=cfg.idempotent_producer,
            options=cfg.producer_options,
        )
        dead_letters = DeadLetters(publisher, cfg, self.processor.consumer)
        self._schedule.paused.clear()
        self._positions.clear()
        if self._ownership is not None:
            self._ownership.owned.clear()
            self._ownership.pending.clear()
        self._in_flight = InFlight()  # bound to this run's event loop
        self._width = in_flight_limit(self.handler.dedup.engine, cfg.partitions_in_flight)
        self.consumer = consumer
        try:
            try:
                if not await self._started(consumer):
                    return  # stopped before the broker answered: nothing read, nothing to commit
            except KafkaError as exc:  # refused credentials are fatal: retrying cannot fix them
                where, options = self.bootstrap_servers, cfg.consumer_options
                sasl = exc if isinstance(exc, connection.SASL_FAILURES) else None
                if sasl or (sasl := await connection.sasl_refusal(where, options)):
                    raise connection.authentication_failed(sasl, where) from exc
                raise
            # Subscribed once started, not before: start() would then wait for the group's
            # first assignment, unbounded and deaf to stop() (a join the broker holds while
            # a member is slow to rejoin). The loop joins while it polls, ticking and
            # stoppable; ``ready`` comes with the assignment.
            consumer.subscribe(list(self.topics), listener=listener)
            # Now, not at the first dead letter: a producer the broker will not start (an
            # idempotent one on Tansu) is a setup fault (BrokerRefused, a ConfigurationError
            # naming idempotent_producer=False), said before any record is read.
            await publisher.start()
            collector.freeze_once()  # set up: the collector stops walking it (collector.py)
            await self._until_deadline(self._consume(consumer, dead_letters, until_idle))
            self.breaker.raise_if_open()  # it stopped taking messages: CircuitOpen
        except DeadlinePassed as passed:
            self.gave_up(passed)
        finally:
            self._set_ready(False)
            self.consumer = None
            # Auto-commit is off: closing commits nothing, whatever ended the loop; so a
            # close the group coordinator holds up is cut short (connection.close_consumer).
            await connection.close_consumer(consumer)
            await publisher.stop()

    async def _started(self, consumer: Any) -> bool:
        """``consumer.start()``: its bootstrap waits on a broker that accepts and does not
        answer up to aiokafka's request_timeout_ms (40 s). False if stop() came first (the
        close in run()'s finally closes what it opened)."""
        started, _ = await self._stoppable(consumer.start())
        return started

    async def _stoppable(
        self, work: Awaitable[T], news: asyncio.Future[None] | None = None
    ) -> tuple[bool, T | None]:
        """``work``, ticking while it waits (alive: held by the broker, not stuck) and
        cancelled on stop() or when run() is cancelled: (True, its result), or (False,
        None) if stop() came first; cancelled too once ``news`` is done: (True, None).
        stop() is looked at every _HELD_CHECK, whatever poll_timeout is: a long one must
        not hold a SIGTERM up."""
        task: asyncio.Future[Any] = asyncio.ensure_future(work)
        waiting: set[asyncio.Future[Any]] = {task} if news is None else {task, news}
        try:
            while True:
                done, _ = await asyncio.wait(
                    waiting, timeout=_HELD_CHECK, return_when=asyncio.FIRST_COMPLETED
                )
                if task in done:
                    return True, task.result()
                if news is not None and news.done():
                    return True, None
                self.tick()
                if self.stopping:
                    return False, None
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _consume(self, consumer: Any, dead_letters: DeadLetters, until_idle: bool) -> None:
        schedule = self._schedule
        poll = self.config.poll_timeout.total_seconds()
        while not self.stopping:
            self.tick()
            schedule.resume_due(consumer)
            if self._ownership is not None and self._ownership.pending:
                await self._ownership.take(consumer, self._positions, lambda: self._in_flight.epoch)
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
                taking = self._ownership is not None and self._ownership.pending
                if until_idle and not schedule.paused and not taking and await self._idle(consumer):
                    return
                continue
            await self._handle_fetch(consumer, dead_letters, fetched, epoch)

    async def _check_startup(self) -> None:
        await self.processor.check_startup()
        if self._ownership is not None:
            await self._ownership.check_startup(self.handler)

    def _assigned(self, consumer: Any, assigned: Any) -> None:
        self._in_flight.assigned()
        if self._ownership is not None:
            self._ownership.assigned(consumer, assigned)
        self._set_ready(True)  # a member given no partition is ready too: the group is joined

    async def _until_deadline(self, consuming: Coroutine[Any, Any, None]) -> None:
        """Await ``consuming`` in run()'s own task; past the deadline given to stop(), a
        watcher cancels that task: the chunks in flight roll back or, committed, are not acked
        (DeadlinePassed), and come again. Not a task of its own: a BaseException a handler
        raises (SystemExit, KeyboardInterrupt) must leave run() as it is, not the event loop."""
        current = asyncio.current_task()
        assert current is not None  # run() is a coroutine awaited by a task
        fired = asyncio.Event()
        watcher = asyncio.ensure_future(self._watch_deadline(current, fired))
        try:
            await consuming
        except asyncio.CancelledError:
            if not fired.is_set():
                raise  # run() itself was cancelled
        finally:
            watcher.cancel()
        if fired.is_set():  # cancelled by the watcher, whether or not the loop swallowed it
            current.uncancel()
            raise DeadlinePassed("the chunks in flight were cancelled")

    async def _watch_deadline(self, consuming: asyncio.Task[Any], fired: asyncio.Event) -> None:
        while True:
            left = self.deadline_left
            if left is not None and left <= 0:
                fired.set()
                consuming.cancel()
                return
            await asyncio.sleep(_DEADLINE_CHECK if left is None else min(left, _DEADLINE_CHECK))

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
        fetched = await self._getmany(consumer, (), wait_ms, size)
        if fetched:
            for tp in consumer.assignment() - fetched.keys() - consumer.paused():
                if self.stopping:
                    break
                # Stoppable too: a rebalance begun since the first holds these as well.
                fetched.update(await self._getmany(consumer, (tp,), 0, size))
        return fetched

    async def _getmany(
        self, consumer: Any, partitions: tuple[Any, ...], wait_ms: int, size: int
    ) -> dict[Any, list[Any]]:
        """``getmany``, ticking and stoppable even while a rebalance holds it: aiokafka's
        getmany waits for the assignment whatever its timeout, and a JoinGroup lasts until
        every member has rejoined (a frozen one: its whole session). Cancelled on stop, it
        has taken nothing (records it had fetched stay in the fetcher, uncommitted)."""
        fetching = consumer.getmany(*partitions, timeout_ms=wait_ms, max_records=size)
        # Offsets in the database: partitions assigned meanwhile wait, paused, to be taken.
        news = None if self._ownership is None else self._ownership.news()
        fetched, got = await self._stoppable(fetching, news)
        return got if fetched and got is not None else {}

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
                        await self._read_again(consumer, tp, records[start].offset)
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
                    await self._read_again(consumer, tp, (found or refused)[0].offset)
                return
            try:
                if found and not await self._handle(consumer, dead_letters, tp, found):
                    continue  # sought back: the range comes again after them
                if refused:
                    await self._handle(consumer, dead_letters, tp, refused)
            finally:
                self._in_flight.end()

    async def _read_again(self, consumer: Any, tp: Any, first: int) -> None:
        """Records from ``first`` on were fetched but not handled: read them again (from the
        offset in the database, when it is kept there and ``tp`` is owned)."""
        stored = None if self._ownership is None else self._ownership.start_of(tp)
        if stored is None:
            await acks.read_again(consumer, tp, first)
        else:
            acks.seek(consumer, tp, stored)

    async def _handle(
        self, consumer: Any, dead_letters: DeadLetters, tp: Any, records: Sequence[Any]
    ) -> bool:
        """One transaction, its dead letters, its offset commit; False if it sought back."""
        if self._ownership is not None:
            return await self._handle_in_database(consumer, dead_letters, tp, records)
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

    async def _handle_in_database(
        self, consumer: Any, dead_letters: DeadLetters, tp: Any, records: Sequence[Any]
    ) -> bool:
        """``_handle`` with the offset in the chunk's transactions: the database moved the
        partition on before any dead letter or broker commit; False if it sought back or
        the partition is not (or no longer) this consumer's."""
        ownership = self._ownership
        assert ownership is not None
        owned = ownership.owned.get(tp)
        if owned is None:  # fenced, or not taken yet: its owner reads it from the database
            return False
        if owned.stored is not None and records[0].offset < owned.stored:
            # Committed already. Read at all only after a reset of the position (the
            # database's offset past the log's end: a topic deleted and made again).
            logger.warning(
                "%s: records from offset %d read below the database's offset %d are skipped "
                "(a topic made again keeps its old offsets in consumer_offsets: delete them)",
                tp,
                records[0].offset,
                owned.stored,
            )
            records = [r for r in records if r.offset >= owned.stored]
            if not records:
                return True
        # A copy `failed replay` sent is claimed even offsets only: a replay killed before
        # its commit on the dead-letter topic sends it again, at another offset.
        claims = ownership.claims or any(
            key == REPLAYED_HEADER for record in records for key, _ in record.headers
        )
        first = records[0].offset
        fence = ownership.store.fence(tp.topic, tp.partition, owned, claims, first=first)
        results = await self._process(records, fence)
        if fence.fenced:
            ownership.fenced(consumer, tp)
            return False
        ownership.store.committed(owned, fence)
        self.committed(results)  # the before_ack hook: a SimulatedCrash leaves from here
        done = next((i for i, r in enumerate(results) if r.outcome is Outcome.RETRY), len(results))
        if done:
            target = records[done - 1].offset + 1
            # The dead letters first: with claims the transactions stopped the offset before
            # the first FAILED record, and refused records at the chunk's end were decided
            # with nothing to commit; killed before the advance, they are read again.
            await self._dead_letters_in_database(dead_letters, records[:done], results[:done])
            covered = (fence.written or 0) >= target
            if not covered and not await ownership.advance(consumer, tp, fence, target):
                return False
            owned.stored = target
            self._schedule.settled(records[:done])
            await acks.commit(consumer, tp, target)  # for lag tooling: the database decides
        if done < len(records):  # read again from it (looked up below recheck_until)
            self._schedule.retry(consumer, tp, records[done], results[done])
            self._positions[tp] = records[done].offset
            return False
        self._positions[tp] = records[-1].offset + 1
        return True

    async def _dead_letters_in_database(
        self, dead_letters: DeadLetters, records: Sequence[Any], results: Sequence[Result]
    ) -> None:
        """The FAILED records' dead letters, tried DEAD_LETTER_TRIES times: the offset is
        past them already, so they are not read again; one still unsent is logged at ERROR
        with its coordinates (its FAILED record stays in processed_events, its record in the
        topic until the topic's retention)."""
        sent = await dead_letters.send_failed(records, results)
        for tries in range(1, DEAD_LETTER_TRIES):
            if sent == len(records) or self.stopping:
                break
            await asyncio.sleep(self._schedule.backoff.delay(tries))
            sent += await dead_letters.send_failed(records[sent:], results[sent:])
        for record, result in zip(records[sent:], results[sent:], strict=True):
            if result.outcome is Outcome.FAILED:
                logger.error(
                    "%s[%d] offset %d (id %r) FAILED and not dead-lettered: the broker refused "
                    "or was away %d times; its FAILED record is kept (consumerdedup failed "
                    "list), the record stays in the topic at that offset",
                    record.topic,
                    record.partition,
                    record.offset,
                    result.message.id,
                    DEAD_LETTER_TRIES,
                )

    async def _process(self, records: Sequence[Any], fence: Any = None) -> list[Result]:
        # A chunk is one partition's records in offset order: nothing commits behind a retry.
        delivered = [to_message(record, self.config) for record in records]
        return await self.processor.process(delivered, ordered=True, fence=fence)

    async def _revoked(self, revoked: Any) -> None:
        await self._in_flight.revoke()  # the chunks in flight finish and commit first
        if self._ownership is not None:  # none of their offsets is written from now on
            self._ownership.revoked(revoked)
        for tp in revoked:
            self._schedule.forget(tp)
            self._positions.pop(tp, None)
