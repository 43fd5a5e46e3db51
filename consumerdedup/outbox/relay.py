"""OutboxRelay: publishes committed outbox rows at least once, in per-key order.

On PostgreSQL one round is one transaction: claim the rows this relay alone
may publish (per-key advisory locks and SKIP LOCKED), publish them in id order
waiting for each confirmation, mark them published, commit. MySQL and MariaDB
the same, with row locks alone (SKIP LOCKED, each key from its oldest row; see
statements.py and mysql.py). On SQLite a write
transaction locks the whole database, so the round never waits on the broker
inside one: read the rows, publish them, then mark them in a short write
transaction. Either way a crash after a confirmation and before the marks
commit publishes those rows again: each carries its ``event_id``, which the
next consumer dedups.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from contextlib import nullcontext
from typing import Any

from sqlalchemy import Engine

from ..db import dialects, sqlite
from ..errors import ConfigurationError
from ..lifecycle import StopSwitch
from ..options import instance, refuse
from ..reasons import describe
from ..schema import DEFAULT, Tables, utcnow
from ..startup import require_startup
from . import lock_space
from .listener import Listener
from .mysql import is_mysql, require_skip_locked
from .publisher import AsyncPublisher, Publisher
from .relay_config import RelayConfig
from .rounds import RoundPublisher
from .sending import Sender
from .statements import RelayStatements

logger = logging.getLogger("consumerdedup.relay")

__all__ = ["OutboxRelay", "RelayConfig"]

_READ_COMMITTED = "READ COMMITTED"
_ENGINE = "a sqlalchemy Engine (create_engine(...)); the relay blocks, run it in a thread"


class OutboxRelay(StopSwitch):
    """Moves outbox rows to a broker. ``run()`` until stopped; ``run_once()`` for one round.

    Order: rows with the same key are published in the order they were added
    (Outbox.add serializes same-key producers on PostgreSQL, relays lock the
    key while publishing it, and a key whose older row is backing off or
    parked is held back). Rows without a key carry no order promise.
    Several relays may run at once; none publishes a row another has in flight.
    """

    def __init__(
        self,
        engine: Engine,
        publisher: Publisher | AsyncPublisher,
        *,
        tables: Tables = DEFAULT,
        config: RelayConfig | None = None,
    ) -> None:
        super().__init__()
        instance(engine, "OutboxRelay.engine", Engine, _ENGINE)
        # An instance: a Publisher class has publish too, and would fail at the first row.
        if isinstance(publisher, type) or not callable(getattr(publisher, "publish", None)):
            raise refuse("OutboxRelay.publisher", publisher, "a Publisher or an AsyncPublisher")
        tables = instance(tables, "OutboxRelay.tables", Tables, "a Tables (Tables.define(...))")
        config = (
            config
            if config is None
            else instance(config, "OutboxRelay.config", RelayConfig, "a RelayConfig or None")
        )
        dialects.require_transactional(engine, "OutboxRelay", driver=False)  # locks need one
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self.mysql = is_mysql(engine.dialect.name)
        self.locking = self.postgres or self.mysql  # a round is one transaction, locks held
        self.publisher = publisher
        self.sender = Sender(publisher)
        self.tables = tables
        self.config = config or RelayConfig()
        self.statements = RelayStatements(
            tables, engine.dialect.name, engine_dialect=engine.dialect
        )
        self.rounds = RoundPublisher(self.sender, self.statements, self.config)
        self.published = 0
        self._idle = threading.Condition()
        self._rounds = 0
        self._broker_trouble = False
        self._checked = False  # the start checks passed (once per relay)

    def _check_startup(self) -> None:
        """Once per relay, before the first claim: ``startup.require_startup`` (the database
        reachable, consumerdedup's own tables present, the rights to write them)."""
        if not self._checked:
            require_startup(self.engine, self.tables, [self.tables.outbox])
            if self.mysql:
                with self.engine.connect() as conn:
                    require_skip_locked(conn, "OutboxRelay")
            self._checked = True

    def run_once(self) -> int:
        """One round: claim, publish, mark, commit. Returns how many rows were published."""
        self._check_startup()  # a missing table or right stops it here
        self.sender.check_thread()  # before any row is claimed
        with self.engine.connect() as conn:
            return self._round_on(conn)

    def _round_on(self, conn: Any) -> int:
        """One round in a transaction of its own on ``conn``; the count published."""
        self._broker_trouble = False
        if self.locking:  # the key or row locks taken by the claim hold until the marks commit
            # Before our level would turn the driver's own autocommit off: refused, as
            # for Outbox.add, not silently mended.
            dialects.require_transaction(conn, "OutboxRelay", driver=False)
            # The claim asks again after its locks, in a statement of its own: that needs
            # a snapshot per statement, whatever level the engine was made with.
            if conn.get_execution_options().get("isolation_level") != _READ_COMMITTED:
                # Once per connection: a drain's rounds share one, and MySQL's dialect sends
                # SET SESSION and a COMMIT each time it is set.
                conn.execution_options(isolation_level=_READ_COMMITTED)
            try:
                with conn.begin():
                    dialects.require_transaction(conn, "OutboxRelay", driver=False)
                    done = self._round(conn, self._claim(conn))
            except Exception as exc:
                if not lock_space.is_lock_table_full(exc):
                    raise
                raise self._lock_table_full(conn, exc) from exc
        else:
            with conn.begin():  # reads only: SQLite takes no write lock
                rows = self._claim(conn)
            done = self._round(conn, rows)
        self.published += done
        return done

    def _lock_table_full(self, conn: Any, error: Exception) -> lock_space.LockTableFull:
        """The named error for a round that met "out of shared memory", with the server's
        lock settings when they can be read (the round's transaction is rolled back)."""
        try:
            with conn.begin():
                table: lock_space.LockTable | None = lock_space.read_lock_table(conn)
        except Exception:  # the table is still full, or the connection went: said without
            table = None
        return lock_space.lock_table_full(error, self.config.batch_size, table)

    def _claim(self, conn: Any) -> list[Any]:
        return self.statements.claim(conn, utcnow(), self.config.batch_size)

    def _round(self, conn: Any, rows: list[Any]) -> int:
        """Publish ``rows`` in order, then mark what became of them; returns the count sent."""
        if rows and not self._open_publisher():
            return 0  # the broker is away: nothing is charged, the round backs off
        result = self.rounds.publish(rows)
        self._broker_trouble = result.broker_away
        with nullcontext() if self.locking else sqlite.transaction(conn):
            self.rounds.record(conn, result)
        return len(result.done)

    def drain(self) -> int:
        """Publish everything that can go now; returns the count. For tests: no sleeping.

        Its rounds, each a transaction of its own, share one connection: a pool that hands
        its connections out in turn (QueuePool's default) gave each round another server
        process, whose caches and prepared statements were cold for the claim (measured:
        4% of a drain's time with five pooled connections)."""
        self._check_startup()
        self.sender.check_thread()
        total = 0
        with self.engine.connect() as conn:
            while (count := self._round_on(conn)) > 0:
                total += count
        return total

    def run(self) -> None:
        """Publish until stop(): rounds back to back while there is work, else wait for news."""
        # A missing table or right stops it here, before LISTEN; a database away is waited for.
        if not self.start_checked(self._check_startup):
            return
        listener = Listener(self.engine, self.tables.outbox, self.tables.notify_channel)
        failures = 0
        try:
            # LISTEN before the first round: a row committed after the round's claim would
            # otherwise wake nobody, and wait the whole poll interval.
            listener.listen()
            self._open_publisher()  # a publisher that cannot start stops run() here
            self._set_ready(True)
            while not self.stopping:
                self.tick()
                try:
                    count = self.run_once()
                except ConfigurationError:
                    raise  # a setup fault (the publisher cannot start): retrying cannot help
                except lock_space.LockTableFull as exc:  # transient, or a round too big
                    failures += 1
                    logger.error("%s", exc)
                    self.pause(self.config.backoff(failures).total_seconds())
                    continue
                except Exception as exc:  # the database went away: keep trying
                    failures += 1
                    logger.warning("relay round failed (%s); retrying", describe(exc))
                    self.pause(self.config.backoff(failures).total_seconds())
                    continue
                finally:
                    self._round_done()
                if self._broker_trouble:
                    failures += 1
                    self.pause(self.config.backoff(failures).total_seconds())
                    continue
                failures = 0
                if count < self.config.batch_size:
                    listener.wait(self.config.poll_interval.total_seconds(), self)
        finally:
            self._set_ready(False)
            listener.close()
            self.close()

    def close(self) -> None:
        """Leave the publisher's context (it was entered before the first publish)."""
        self.sender.close()

    def __enter__(self) -> OutboxRelay:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_drained(self, timeout: float = 30.0) -> bool:
        """Block until every committed, unparked row is published; True if within ``timeout``.

        For tests with the relay running in the background: call it after
        committing, instead of sleeping.
        """
        deadline = time.monotonic() + timeout
        while self.backlog() > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._idle:
                self._idle.wait(min(left, 0.2))  # woken at the end of each round
        return True

    async def drained(self, timeout: float = 30.0) -> bool:
        """``wait_drained`` for asyncio code."""
        return await asyncio.to_thread(self.wait_drained, timeout)

    @property
    def broker_away(self) -> bool:
        """The last round ended because the broker could not be reached (nothing charged)."""
        return self._broker_trouble

    def parked(self) -> list[tuple[str, str | None]]:
        """(event_id, last_error) of the parked rows (parked_at set, not abandoned): no
        relay tries them until they are replayed."""
        with self.engine.connect() as conn:
            return self.statements.parked(conn)

    def backlog(self) -> int:
        """Unpublished rows that are neither parked nor abandoned."""
        with self.engine.connect() as conn:
            return self.statements.backlog(conn)

    def _open_publisher(self) -> bool:
        """Start the publisher (at run(), else before the first publish); False if its broker
        is away (the round backs off).

        A publisher that cannot start is the relay's fault, not an event's: no attempt is
        charged. A broker that does not answer is transient; anything else (a refused
        handshake, bad credentials, an error we cannot place) stops the relay with a
        ConfigurationError that says what to change.
        """
        try:
            self.sender.open()
        except ConfigurationError:
            raise
        except Exception as exc:
            if isinstance(exc, ConnectionError | TimeoutError):
                self._broker_trouble = True
                logger.warning("cannot start the publisher: %s; backing off", describe(exc))
                return False
            raise ConfigurationError(
                f"the relay's publisher cannot start: {describe(exc)}"
            ) from exc
        return True

    def _round_done(self) -> None:
        with self._idle:
            self._rounds += 1
            self._idle.notify_all()
