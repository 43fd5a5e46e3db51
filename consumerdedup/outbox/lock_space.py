"""PostgreSQL's shared lock table, and how much of it a relay round takes.

A relay round holds one transaction-level advisory lock per distinct key it claims
(statements.py), until the round's marks commit: at most ``batch_size`` of them (its
claim never covers more rows than that; measured: 100 locks at ``batch_size=100``, 875
at 1000 with another relay holding half the keys), plus about a dozen relation locks on
the outbox table and its indexes. ``publish_window`` does not change that count: it
only splits the claimed rows into windows of confirmations.

Every lock of every transaction on the server shares one table, sized at start:
``max_locks_per_transaction * (max_connections + max_prepared_transactions)`` entries
(PostgreSQL's documented size; the real table is a little larger, as background
processes count too and spare shared memory absorbs some overflow). A transaction
that needs one more entry than is free fails with SQLSTATE 53200, "out of shared
memory", hint "You might need to increase max_locks_per_transaction". The relay
turns that into LockTableFull, which names both fixes; ``run()`` logs it and backs off.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from ..errors import ConsumerDedupError

OUT_OF_MEMORY = "53200"
"""SQLSTATE out_of_memory: the lock table's "out of shared memory" and any other."""
SETTING = "max_locks_per_transaction"
RELATION_LOCKS = 16
"""Relation locks a round may hold besides its advisory ones (12 measured: the outbox
table, its indexes, the statements' relations), rounded up."""


def round_locks(batch_size: int) -> int:
    """The lock-table entries one relay round may hold at once: one advisory lock per
    claimed key (at most ``batch_size``) plus its relation locks."""
    return batch_size + RELATION_LOCKS


@dataclass(frozen=True)
class LockTable:
    """The server's lock-table settings, and the capacity PostgreSQL documents for them."""

    max_locks_per_transaction: int
    max_connections: int
    max_prepared_transactions: int

    @property
    def capacity(self) -> int:
        return self.max_locks_per_transaction * (
            self.max_connections + self.max_prepared_transactions
        )

    def describe(self) -> str:
        return (
            f"{SETTING}={self.max_locks_per_transaction} x (max_connections="
            f"{self.max_connections} + max_prepared_transactions="
            f"{self.max_prepared_transactions}) = {self.capacity:,} shared lock slots"
        )


def read_lock_table(conn: Connection) -> LockTable:
    """The three settings, as the server runs with them (PostgreSQL)."""
    row = conn.execute(
        text(
            "SELECT current_setting('max_locks_per_transaction'), "
            "current_setting('max_connections'), current_setting('max_prepared_transactions')"
        )
    ).one()
    return LockTable(int(row[0]), int(row[1]), int(row[2]))


class LockTableFull(ConsumerDedupError):
    """A relay round ran out of PostgreSQL's shared lock table (SQLSTATE 53200, "out of
    shared memory"). Nothing of the round committed: no row was marked or charged, and
    those it published already go again (consumers dedup them by event_id). Transient
    when other transactions filled the table; a round too big for the server meets it
    every time: lower ``RelayConfig.batch_size`` or raise ``max_locks_per_transaction``."""

    def __init__(self, text_: str, table: LockTable | None = None) -> None:
        super().__init__(text_)
        self.table = table


def is_lock_table_full(error: BaseException) -> bool:
    """``error`` (or what it wraps: SQLAlchemy's ``orig``, the ``__cause__`` chain) is the
    server's "out of shared memory" for the lock table: SQLSTATE 53200 whose hint or
    message names max_locks_per_transaction or shared memory. A plain "out of memory"
    (53200 for work_mem and the like) is not: the lock settings cannot help it."""
    for found in _chain(error):
        if getattr(found, "sqlstate", None) != OUT_OF_MEMORY:
            continue
        diag = getattr(found, "diag", None)
        said = " ".join(
            str(part)
            for part in (
                getattr(diag, "message_primary", None),
                getattr(diag, "message_hint", None),
                str(found),
            )
            if part
        )
        # The setting's name is never translated; the message is (lc_messages).
        if SETTING in said or "shared memory" in said:
            return True
    return False


def _chain(error: BaseException) -> Iterator[Any]:
    seen: set[int] = set()
    stack: list[Any] = [error]
    while stack:
        found = stack.pop()
        if found is None or id(found) in seen:
            continue
        seen.add(id(found))
        yield found
        stack += [getattr(found, "orig", None), found.__cause__, found.__context__]


def lock_table_full(
    error: BaseException, batch_size: int, table: LockTable | None
) -> LockTableFull:
    """The relay's named error for ``error``, with the setting to raise and the option to
    lower (``table``: the server's settings if they could be read)."""
    sizes = f" ({table.describe()})" if table is not None else ""
    return LockTableFull(
        "the relay's round ran out of PostgreSQL's shared lock table (SQLSTATE 53200, "
        f"out of shared memory){sizes}: a round holds one advisory lock per distinct key "
        f"it claims, up to RelayConfig.batch_size={batch_size} (`relay --batch-size`), "
        "until it commits, on top of every other transaction's locks. Lower batch_size "
        f"(publish_window does not change the count), or raise {SETTING} in "
        "postgresql.conf (a server restart); `consumerdedup doctor` compares the two. "
        "Nothing of the round committed; a running relay backs off and tries again",
        table,
    )
