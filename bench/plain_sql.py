"""The SQL the hand-written baselines send: what the pipeline sends, without SQLAlchemy.

A claim is one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` of the batch's ids into the
same processed_events the pipeline uses (under another consumer name): what comes back was
claimed by this transaction, the rest were there already (duplicates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def claim_many(processed_events: str) -> str:
    """Parameters: consumer, the ids (a list), their payload hashes (a list)."""
    return (
        f"INSERT INTO {processed_events} (consumer, message_id, processed_at, payload_hash, "
        "outcome, error) SELECT %s, m, now(), h, 'processed', NULL "
        "FROM unnest(%s::varchar[], %s::varchar[]) AS t(m, h) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )


def hashes(bodies: Iterable[bytes]) -> list[str]:
    """sha256 hex of each body, as the pipeline records it."""
    return [hashlib.sha256(body).hexdigest() for body in bodies]
