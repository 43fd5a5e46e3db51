"""The claim's SQL on a processed_events partitioned by day, where no key is unique.

PostgreSQL cannot keep (consumer, message_id) unique across partitions, so
``INSERT ... ON CONFLICT`` has nothing to conflict on. A claim is two
statements instead: a per-key advisory lock, held to the end of the
transaction, then one INSERT of the keys no partition holds yet. The INSERT
is a new statement, so under READ COMMITTED it sees whatever the lock's
previous holder committed. Lookups probe each partition's index per key
(LATERAL ... LIMIT 1) whatever the planner's statistics say: a day's
partition is at its busiest while it is young and not yet analyzed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import DateTime, Integer, String, Table, TextualSelect, bindparam, text

from ..db import locks
from ..db.names import table_sql


def lookup(table: Table) -> TextualSelect:
    return (
        text(
            "SELECT k.key AS message_id, r.payload_hash, r.outcome, r.error "
            "FROM unnest(CAST(:keys AS text[])) AS k(key) CROSS JOIN LATERAL "
            f"(SELECT payload_hash, outcome, error FROM {table_sql(table)} "
            "WHERE consumer = :consumer AND message_id = k.key LIMIT 1) AS r"
        )
        .bindparams(bindparam("consumer", type_=String()))
        .columns(message_id=String(), payload_hash=String(), outcome=String(), error=String())
    )


def lock(table: Table) -> TextualSelect:
    """Locks (consumer, key) on ``table``, in hash order so two batches sharing keys cannot
    deadlock.

    The ordered subquery is not flattened, so the locks are taken in its order;
    the isolation level comes back so the caller can refuse anything but READ COMMITTED.
    """
    return (
        text(
            "SELECT current_setting('transaction_isolation') AS isolation, count(*) AS locked "
            f"FROM (SELECT pg_advisory_xact_lock({locks.SPACE_SQL}, h) FROM (SELECT DISTINCT "
            "hashtext(:consumer || '/' || k) AS h FROM unnest(CAST(:keys AS text[])) AS k "
            "ORDER BY h) AS hashes) AS held"
        )
        .bindparams(bindparam("consumer", type_=String()), **locks.space_params(locks.CLAIM, table))
        .columns(isolation=String(), locked=Integer())
    )


def record(table: Table) -> TextualSelect:
    """INSERT the rows whose key no partition holds; RETURNING the keys inserted."""
    name = table_sql(table)
    return (
        text(
            f"INSERT INTO {name} "
            "(consumer, message_id, processed_at, payload_hash, outcome, error) "
            "SELECT :consumer, r.message_id, :processed_at, r.payload_hash, r.outcome, r.error "
            "FROM unnest(CAST(:ids AS text[]), CAST(:hashes AS text[]), "
            "CAST(:outcomes AS text[]), CAST(:errors AS text[])) "
            "AS r(message_id, payload_hash, outcome, error) "
            "LEFT JOIN LATERAL (SELECT 1 AS hit FROM "
            f"{name} WHERE consumer = :consumer AND message_id = r.message_id LIMIT 1) AS f "
            "ON true WHERE f.hit IS NULL RETURNING message_id"
        )
        .bindparams(
            bindparam("consumer", type_=String()),
            bindparam("processed_at", type_=DateTime(timezone=True)),
        )
        .columns(message_id=String())
    )


def record_params(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One call's rows (one consumer, one processed_at) as the arrays ``record`` takes."""
    first = rows[0]
    return {
        "consumer": first["consumer"],
        "processed_at": first["processed_at"],
        "ids": [row["message_id"] for row in rows],
        "hashes": [row["payload_hash"] for row in rows],
        "outcomes": [row["outcome"] for row in rows],
        "errors": [row["error"] for row in rows],
    }
