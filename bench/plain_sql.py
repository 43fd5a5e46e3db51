"""The SQL the hand-written baselines send: what the pipeline sends, without SQLAlchemy.

A claim is one ``INSERT ... ON CONFLICT DO NOTHING RETURNING`` of the batch's ids into the
same processed_events the pipeline uses (under another consumer name): what comes back was
claimed by this transaction, the rest were there already (duplicates).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import Message


def claim_many(processed_events: str) -> str:
    """Parameters: consumer, the ids (a list), their payload hashes (a list)."""
    return (
        f"INSERT INTO {processed_events} (consumer, message_id, processed_at, payload_hash, "
        "outcome, error) SELECT %s, m, now(), h, 'processed', NULL "
        "FROM unnest(%s::varchar[], %s::varchar[]) AS t(m, h) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )


def claim_by_hand(session: Session, processed_events: str, part: Sequence[Message]) -> set[str]:
    """The multi-row claim of ``part`` written by hand through a plain SQLAlchemy Session
    (consumer 'hand'): the ids it claimed. The ceilings' claim."""
    claim = text(
        f"INSERT INTO {processed_events} (consumer, message_id, processed_at, payload_hash, "
        "outcome, error) SELECT 'hand', m, now(), h, 'processed', NULL "
        "FROM unnest(CAST(:ids AS varchar[]), CAST(:hashes AS varchar[])) AS t(m, h) "
        "ON CONFLICT (consumer, message_id) DO NOTHING RETURNING message_id"
    )
    params = {"ids": [m.id for m in part], "hashes": hashes(m.body for m in part)}
    return set(session.execute(claim, params).scalars())


def hashes(bodies: Iterable[bytes]) -> list[str]:
    """sha256 hex of each body, as the pipeline records it."""
    return [hashlib.sha256(body).hexdigest() for body in bodies]
