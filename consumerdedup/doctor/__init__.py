"""``doctor``: check a deployment, one ``Check`` per line (ok / warn / FAIL) with its fix.

``diagnose(engine, tables)`` runs every check and returns the list; a FAIL is a
problem that breaks a guarantee or stops work (exit non-zero), a warn is
worth a look. Each check is a small function of ``checks`` (the database, its
tables, indexes, trigger and version) or ``health`` (partitions, the outbox,
records past their window, PostgreSQL's shared lock table against the relays' rounds,
the broker's retention) or ``failures`` (FAILED records, dead letters waiting). Nothing
here changes the database: the write probe on SQLite rolls back, on PostgreSQL it asks
``has_table_privilege``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine

from ..options import duration, instance, integer, mapping, maybe, names, settle
from ..prune.windows import BrokerRetention, check_window
from ..schema import DEFAULT, Tables
from ..startup import (
    FAIL,
    OK,
    WARN,
    Check,
    failed,
    require_startup,
    require_startup_async,
    startup_checks,
    startup_checks_async,
)

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Check",
    "Settings",
    "diagnose",
    "failed",
    "require_startup",
    "require_startup_async",
    "startup_checks",
    "startup_checks_async",
]


@dataclass(frozen=True)
class Settings:
    """What the checks compare against; the windows as ``prune`` takes them.

    ``retention`` is every consumer's window, ``windows`` a consumer's own (None: kept
    forever); ``broker`` the retention a broker reported for ``consumers``.
    """

    retention: timedelta | None = None
    windows: Mapping[str, timedelta | None] = field(default_factory=dict)
    buffer: timedelta | None = None
    broker: BrokerRetention | None = None
    consumers: Sequence[str] = ()
    max_attempts: int = 10
    outbox_max_age: timedelta = timedelta(minutes=5)
    now: datetime | None = None
    relays: int = 1
    """Relays running against this database at once (the lock-table check)."""
    relay_batch_size: int | None = None
    """Their RelayConfig.batch_size (`relay --batch-size`); None: the default."""
    max_failed: int | None = None
    """FAILED records (or dead letters waiting) above which a line is a FAIL, not a warn;
    None: any number is a warn."""
    dead_letters: Mapping[str, int | None] | None = None
    """Dead letters waiting in each dead-letter queue or topic, as the broker said (None:
    not there); None: no broker was asked."""

    def __post_init__(self) -> None:
        at = "Settings."
        settle(self, "retention", check_window(self.retention, at + "retention"))
        given = mapping(self.windows, at + "windows")
        windows = {name: check_window(w, f"{at}windows[{name!r}]") for name, w in given.items()}
        settle(self, "windows", windows)
        settle(self, "buffer", check_window(self.buffer, at + "buffer", none="for the default"))
        maybe(self.broker, at + "broker", instance, BrokerRetention, "a BrokerRetention or None")
        settle(self, "consumers", names(self.consumers, at + "consumers", empty=True))
        settle(self, "max_attempts", integer(self.max_attempts, at + "max_attempts", at_least=1))
        settle(self, "outbox_max_age", duration(self.outbox_max_age, at + "outbox_max_age"))
        maybe(self.now, at + "now", instance, datetime, "an aware datetime or None")
        settle(self, "relays", integer(self.relays, at + "relays", at_least=1))
        maybe(self.relay_batch_size, at + "relay_batch_size", integer, at_least=1)
        maybe(self.max_failed, at + "max_failed", integer, at_least=0)

    def at(self) -> datetime:
        return self.now or datetime.now(UTC)


def diagnose(
    engine: Engine, tables: Tables = DEFAULT, settings: Settings | None = None
) -> list[Check]:
    """Every check, in order; those that need what an earlier one found missing are left out."""
    from ..startup import structure as checks
    from . import failures, health

    settings = settings or Settings()
    found = [checks.engine_settings(engine)]
    try:
        conn = engine.connect()
    except Exception as error:
        return [*found, checks.unreachable(engine, error)]
    with conn:
        found.append(checks.reachable(conn))
        structure, present = checks.tables(conn, tables)
        found.append(structure)
        found += checks.layout(conn, tables, present)
        if present:
            found.append(checks.write_rights(conn, tables, present))
        if tables.outbox.fullname in present:
            found += checks.notify_trigger(conn, tables)
            found += checks.mysql_outbox(conn, tables)
        found.append(checks.schema_version(conn, tables, present))
        data = {t.fullname for t in tables.all} <= present
        if data:
            found += health.partitions(conn, tables)
            found += health.outbox(conn, tables, settings)
            found.append(health.old_records(conn, tables, settings))
            found.append(failures.failed_records(conn, tables, settings))
        found += health.lock_table(conn, settings)
        found += health.broker_windows(settings)
        found += failures.dead_letters(settings.dead_letters, settings)
        if conn.in_transaction():
            conn.rollback()
    return found
