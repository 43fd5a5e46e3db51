"""PostgreSQL's claim of many keys in one statement of fixed shape: the rows as arrays.

The VALUES form of ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` binds six
parameters a row: for a batch of 500 that is a 3,000-placeholder statement, built,
sent and parsed anew by SQLAlchemy (insertmanyvalues), psycopg (placeholder
conversion: the larger part of a bulk handler's time before this module) and
the server. Here the rows travel as six arrays in one statement whose text never
changes, whatever the batch's size; the same INSERT, the same conflict rule,
the same RETURNING. Rows are inserted in array order, which the caller sorts by key
(the order two batches sharing keys take the keys' locks).
"""

from __future__ import annotations

from sqlalchemy import DateTime, String, Table, TextualSelect, bindparam, text

from ..db.names import table_sql


def record(table: Table) -> TextualSelect:
    """INSERT the rows ON CONFLICT (consumer, message_id) DO NOTHING; RETURNING the keys
    inserted. Parameters: ``partitioned_statements.record_params``."""
    return (
        text(
            f"INSERT INTO {table_sql(table)} "
            "(consumer, message_id, processed_at, payload_hash, outcome, error) "
            "SELECT :consumer, r.message_id, :processed_at, r.payload_hash, r.outcome, r.error "
            "FROM unnest(CAST(:ids AS text[]), CAST(:hashes AS text[]), "
            "CAST(:outcomes AS text[]), CAST(:errors AS text[])) WITH ORDINALITY "
            "AS r(message_id, payload_hash, outcome, error, n) ORDER BY r.n "
            "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
        )
        .bindparams(
            bindparam("consumer", type_=String()),
            bindparam("processed_at", type_=DateTime(timezone=True)),
        )
        .columns(message_id=String())
    )
