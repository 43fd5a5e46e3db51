"""Messages failing: the FAILED records waiting for an operator, and the dead letters
waiting in the brokers' dead-letter queues.

Both are a warn, not a FAIL, by default: a FAILED record keeps every guarantee (the
message is recorded, dead-lettered and acked, its redeliveries answered), but someone has
to look. With ``Settings.max_failed`` (``doctor --max-failed N``) more than N of either
is a FAIL, so a monitor can page on it through the exit code.

Cost: no index has the outcome, so the FAILED records are counted by reading
processed_events twice (count and oldest, then the top reasons): measured 0.3 s per
million rows on the test PostgreSQL (1,000,000 rows, 1,000 FAILED), as ``stats`` costs.
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import Connection, func, select

from ..outcome import Outcome
from ..schema import Tables
from . import FAIL, OK, WARN, Check, Settings
from .health import how_long

TOP_REASONS = 3
"""Reasons named on the line, the most frequent first."""
REASON_CLIP = 60
"""Characters of a reason shown."""
LOOK = "see them: `consumerdedup failed list`; fix the cause, then `consumerdedup failed replay`"


def failed_records(conn: Connection, tables: Tables, settings: Settings) -> Check:
    """How many FAILED records, the oldest's age, and the top reasons (two queries on the
    table; the count of each reason is over the whole table)."""
    pe = tables.processed_events
    failed = pe.c.outcome == Outcome.FAILED.value
    count, oldest = conn.execute(
        select(func.count(), func.min(pe.c.processed_at)).where(failed)
    ).one()
    if not count:
        return Check("failed records", OK, f"no FAILED records in {pe.fullname}")
    top = conn.execute(
        select(pe.c.error, func.count().label("n"))
        .where(failed)
        .group_by(pe.c.error)
        .order_by(func.count().desc(), pe.c.error)
        .limit(TOP_REASONS)
    ).all()
    reasons = ", ".join(f"{_clip(error)} ({n:,})" for error, n in top)
    age = how_long(settings.at(), oldest)
    detail = f"{count:,} FAILED record(s), the oldest for {age}; top reasons: {reasons}"
    return Check("failed records", _status(count, settings), detail, LOOK)


def dead_letters(depths: Mapping[str, int | None] | None, settings: Settings) -> list[Check]:
    """The dead letters waiting in each dead-letter queue or topic read from the broker
    (None: it is not there); nothing without a broker."""
    if depths is None:
        return []
    missing = [name for name, depth in depths.items() if depth is None]
    waiting = {name: depth for name, depth in depths.items() if depth}
    found = []
    if waiting:
        total = sum(waiting.values())
        said = ", ".join(f"{n:,} in {name}" for name, n in waiting.items())
        detail = f"{total:,} dead letter(s) waiting: {said}"
        fix = "see why: `consumerdedup failed list`; fix it, then `consumerdedup failed replay`"
        found.append(Check("dead letters", _status(total, settings), detail, fix))
    elif not missing:
        found.append(Check("dead letters", OK, f"none in {', '.join(depths)}"))
    if missing:
        detail = f"no queue {', '.join(missing)}: a dead letter has nowhere to go"
        fix = "declare it (RabbitConfig(declare=True) or the runner's declare())"
        found.append(Check("dead letters", WARN, detail, fix))
    return found


def _status(count: int, settings: Settings) -> str:
    return FAIL if settings.max_failed is not None and count > settings.max_failed else WARN


def _clip(error: str | None) -> str:
    text = " ".join((error or "(no reason)").split())
    text = "".join(c if c.isprintable() else "?" for c in text)  # a reason is the producer's text
    return text if len(text) <= REASON_CLIP else text[: REASON_CLIP - 1] + "…"
