"""The row batches of a round: expired processed_events, published outbox rows, idempotency keys.

Each batch deletes at most ``batch_size`` rows and is a transaction of its
own (BEGIN IMMEDIATE on SQLite), so no statement holds a long lock; between
batches the Pace tells the progress, notices stop() and pauses if asked to.
A dry run counts the same rows instead.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import Connection

from ..db import sqlite
from ..schema import Tables
from .idempotency import KeyPruneStatements
from .rounds import Pace, Round
from .statements import EARLIEST, PruneStatements


class RowPruner:
    """Deletes (or counts) a round's expired rows, table by table, in bounded batches."""

    def __init__(
        self,
        statements: PruneStatements,
        keys: KeyPruneStatements | None,
        tables: Tables,
        batch_size: int,
        pace: Pace,
    ) -> None:
        self.statements = statements
        self.key_statements = keys
        """None: the idempotency keys are left alone."""
        self.tables = tables
        self.batch_size = batch_size
        self.pace = pace

    def events(self, conn: Connection, state: Round, before: int = 0) -> Counter[str]:
        """processed_events, oldest first; ``before``: rows the round deleted already."""
        deleted: Counter[str] = Counter()
        params = self.statements.params(state.cutoffs.named, state.cutoffs.others)
        if params["upper"] is None:
            return deleted
        lower = EARLIEST
        table = self.tables.processed_events.fullname
        while not self.pace.stopping:
            with sqlite.transaction(conn):  # BEGIN IMMEDIATE on SQLite
                batch = self.statements.delete_batch(
                    conn, {**params, "lower": lower}, self.batch_size
                )
            deleted.update(batch.deleted)
            self.pace.tell(table, before + sum(deleted.values()), state)
            if batch.total < self.batch_size or batch.last is None:
                break
            lower = batch.last  # rows at exactly this time that are left still qualify
            self.pace.breathe()
        return deleted

    def outbox(self, conn: Connection, state: Round) -> int:
        """Outbox rows published (or abandoned) before the outbox cutoff; rows waiting to go
        out, parked ones included, are never touched."""
        deleted = 0
        table = self.tables.outbox.fullname
        while state.outbox is not None and not self.pace.stopping:
            with sqlite.transaction(conn):
                count = self.statements.delete_outbox(conn, state.outbox, self.batch_size)
            deleted += count
            self.pace.tell(table, deleted, state)
            if count < self.batch_size:
                break
            self.pace.breathe()
        return deleted

    def keys(self, conn: Connection, state: Round) -> int:
        """Idempotency keys past their expiry (or keep); a claim in flight stays while leased."""
        statements = self._key_table(conn)
        if statements is None:
            return 0
        deleted = 0
        table = self.tables.idempotency_keys.fullname
        for kind in statements.kinds:
            while not self.pace.stopping:
                with sqlite.transaction(conn):
                    count = statements.delete_batch(conn, state.keys, self.batch_size, kind)
                deleted += count
                if count:  # most rounds find none: no progress line for an empty look
                    self.pace.tell(table, deleted, state)
                if count < self.batch_size:
                    break
                self.pace.breathe()
        return deleted

    def count(self, conn: Connection, state: Round) -> tuple[Counter[str], int]:
        """Dry run: the processed_events rows per consumer and the outbox rows that would go."""
        params = self.statements.params(state.cutoffs.named, state.cutoffs.others)
        events = self.statements.count(conn, params) if params["upper"] is not None else Counter()
        outbox = 0 if state.outbox is None else self.statements.count_outbox(conn, state.outbox)
        return events, outbox

    def count_keys(self, conn: Connection, state: Round) -> int:
        statements = self._key_table(conn)
        return 0 if statements is None else statements.count(conn, state.keys)

    def _key_table(self, conn: Connection) -> KeyPruneStatements | None:
        statements = self.key_statements
        if statements is None or not statements.exists(conn):
            return None  # left alone, or a database from before idempotency keys existed
        conn.commit()  # the look-up's transaction; each batch is one of its own
        return statements
