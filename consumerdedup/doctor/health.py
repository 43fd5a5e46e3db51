"""The deployment at work: partitions, the outbox's backlog, records past their window,
PostgreSQL's shared lock table against the relays' rounds, each consumer's window against
its broker's retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import ColumnElement, Connection, column, func, inspect, select

from .. import durations
from ..db.partitions import AHEAD, DayPartitions
from ..outbox import lock_space
from ..outbox.relay_config import RelayConfig
from ..prune.windows import keep_for
from ..schema import Tables
from . import FAIL, OK, WARN, Check, Settings

PRUNE = "run `consumerdedup prune --every 1h ...` (or a Pruner) with these windows"


def how_long(now: datetime, then: datetime) -> str:
    """How long ago ``then`` was, as durations write it (to the minute past an hour)."""
    seconds = max(int((now - aware(then)).total_seconds()), 1)
    if seconds >= 3600:  # to the minute past an hour
        seconds -= seconds % 60
    return durations.render(timedelta(seconds=seconds))


def partitions(conn: Connection, tables: Tables) -> list[Check]:
    """A partitioned processed_events (PostgreSQL): no rows in DEFAULT, days made ahead."""
    if conn.dialect.name != "postgresql":
        return []
    days = DayPartitions(tables.processed_events)
    summary = days.summary(conn)
    if summary is None:
        return []
    found = []
    stuck = summary["rows_in_default"]
    default = days.qualified(days.default_name)
    if stuck:
        detail = f"{stuck:,} row(s) in {default}: their days cannot get a partition, and go "
        detail += "only by batch DELETE"
        fix = "run the pruner daily (it makes days ahead); the rows go once past their window"
        found.append(Check("default partition", FAIL, detail, fix))
    else:
        found.append(Check("default partition", OK, f"{default} is empty"))
    newest = summary["newest_to"]
    ahead = (datetime.fromisoformat(newest) - datetime.now(UTC)) if newest else None
    fix = "run install() or the pruner (each makes the days ahead)"
    if ahead is None or ahead <= timedelta(0):
        detail = "no partition for today: new rows go to DEFAULT"
        found.append(Check("days ahead", FAIL, detail, fix))
    elif ahead < timedelta(days=2):
        detail = f"partitions only until {newest} (a pruner round makes {AHEAD} days ahead)"
        found.append(Check("days ahead", WARN, detail, fix))
    else:
        found.append(Check("days ahead", OK, f"partitions until {newest}"))
    return found


def outbox(conn: Connection, tables: Tables, settings: Settings) -> list[Check]:
    """The unpublished backlog, its oldest row's age, and the parked rows (parked_at where
    the table has it, else attempts >= max_attempts, as the relay decides)."""
    ob = tables.outbox
    now = settings.at()
    waiting = ob.c.published_at.is_(None)
    is_parked: ColumnElement[bool]
    columns = {c["name"] for c in inspect(conn).get_columns(ob.name, schema=ob.schema)}
    if "parked_at" in columns:
        # A layout that adds parked_at may not be on this Table yet: named by hand then.
        parked_at = ob.c.parked_at if "parked_at" in ob.c else column("parked_at")
        is_parked = parked_at.is_not(None)
        how = "by parked_at"
    else:
        is_parked = ob.c.attempts >= settings.max_attempts
        how = f"by attempts >= {settings.max_attempts}"
    backlog, oldest = conn.execute(
        select(func.count(), func.min(ob.c.created_at)).where(waiting, ~is_parked)
    ).one()
    parked = conn.execute(select(func.count()).where(waiting, is_parked)).scalar_one()
    found = []
    if not backlog:
        found.append(Check("outbox backlog", OK, f"nothing waiting in {ob.fullname}"))
    else:
        age = how_long(now, oldest)
        detail = f"{backlog:,} event(s) waiting in {ob.fullname}, the oldest for {age}"
        stale = aware(oldest) < now - settings.outbox_max_age
        if stale:
            fix = "start `consumerdedup relay` (or the Relay); check its logs for the broker"
            limit = durations.render(settings.outbox_max_age)
            found.append(Check("outbox backlog", FAIL, f"{detail} (over {limit})", fix))
        else:
            found.append(Check("outbox backlog", OK, detail))
    if parked:
        detail = f"{parked:,} event(s) parked ({how}): no relay publishes them"
        fix = "see why: `consumerdedup outbox list`; fix it, then `outbox replay` or `abandon`"
        found.append(Check("parked events", FAIL, detail, fix))
    else:
        found.append(Check("parked events", OK, f"none ({how})"))
    return found


def aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def old_records(conn: Connection, tables: Tables, settings: Settings) -> Check:
    """Records older than their consumer's window + buffer: the pruner is not running.

    One query on the processed_at index, below the shortest window's cutoff."""
    windows = dict(settings.windows)
    if settings.retention is None and not windows:
        fix = "pass --retention DURATION and/or --window CONSUMER=DURATION, as given to prune"
        return Check("old records", WARN, "not checked: no window given", fix)
    now = settings.at()
    keeps = {c: keep_for(w, settings.buffer) for c, w in windows.items()}
    common = keep_for(settings.retention, settings.buffer) if settings.retention else None
    finite = [k for k in [*keeps.values(), common] if k is not None]
    if not finite:
        return Check("old records", OK, "every window given is forever")
    pe = tables.processed_events
    rows = conn.execute(
        select(pe.c.consumer, func.min(pe.c.processed_at), func.count())
        .where(pe.c.processed_at < now - min(finite))
        .group_by(pe.c.consumer)
    ).all()
    late = []
    for consumer, oldest, _count in rows:
        keep = keeps.get(consumer, common)
        if keep is not None and aware(oldest) < now - keep:
            kept = durations.render(keep)
            late.append(f"{consumer} (oldest {how_long(now, oldest)}, kept {kept})")
    if late:
        detail = f"records older than their window + buffer: {', '.join(late)}"
        return Check("old records", FAIL, detail + ": the pruner is not running", PRUNE)
    return Check("old records", OK, "none past its window + buffer")


def lock_table(conn: Connection, settings: Settings) -> list[Check]:
    """PostgreSQL: the relays' rounds against the shared lock table (outbox.lock_space).

    Each relay's round holds up to batch_size advisory locks (one per distinct key it
    claims) plus its relation locks until it commits; the server has
    max_locks_per_transaction x (max_connections + max_prepared_transactions) slots for
    every transaction's locks. Assumed, to be conservative: every relay is mid-round at
    once, the documented size is all there is (the real table is a little larger), and
    every other transaction (consumer batches take one lock per distinct outbox key until
    their COMMIT; the application's own) needs up to half the table: a warn when the
    relays alone could take more than the other half, where "out of shared memory" fails
    rounds, and any other transaction, under load."""
    if conn.dialect.name != "postgresql":
        return []
    table = lock_space.read_lock_table(conn)
    batch = settings.relay_batch_size or RelayConfig().batch_size
    relays = max(settings.relays, 1)
    per_round = lock_space.round_locks(batch)
    need = relays * per_round
    budget = table.capacity // 2
    said = (
        f"{relays} relay(s) x (batch_size {batch} + {lock_space.RELATION_LOCKS}) = up to "
        f"{need:,} locks of {table.describe()}"
    )
    if need <= budget:
        return [Check("lock table", OK, f"{said}: within half of them")]
    largest = max(budget // relays - lock_space.RELATION_LOCKS, 1)
    backends = table.max_connections + table.max_prepared_transactions
    setting = -(-2 * need // backends)  # rounded up
    detail = (
        f"{said}: the relays alone could take over half, and a round that finds no slot "
        "fails with 'out of shared memory' (so does any other transaction then)"
    )
    fix = (
        f"lower the relays' batch_size to {largest} or less (`relay --batch-size`, "
        f"RelayConfig.batch_size; publish_window does not matter), or raise "
        f"max_locks_per_transaction to {setting} or more in postgresql.conf (a restart)"
    )
    return [Check("lock table", WARN, detail, fix)]


def broker_windows(settings: Settings) -> list[Check]:
    """Each named consumer's window against the retention its broker reported."""
    broker = settings.broker
    if broker is None:
        return []
    found = []
    reported = "forever" if broker.window is None else durations.render(broker.window)
    said = f"{broker.broker} keeps {broker.names} {reported}"
    for consumer in settings.consumers:
        window = settings.windows.get(consumer, settings.retention)
        if consumer not in settings.windows and settings.retention is None:
            found.append(Check(f"window {consumer}", OK, f"{said}: prune reads it from there"))
            continue
        shown = "forever" if window is None else durations.render(window)
        if window is None or (broker.window is not None and window >= broker.window):
            found.append(Check(f"window {consumer}", OK, f"{shown}, {said}"))
            continue
        detail = (
            f"window {shown} is shorter than the retention ({broker.describe()}): a "
            "redelivery after the prune finds no record and runs again"
        )
        fix = f"--window {consumer}={reported} (or longer), or prune with the broker's window"
        found.append(Check(f"window {consumer}", FAIL, detail, fix))
    return found
