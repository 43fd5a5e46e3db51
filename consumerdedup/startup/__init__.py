"""Start checks: what a runner, a relay or a pruner verifies before its first message.

A process about to consume or publish checks, once and cheaply, that its database can be
reached, that the tables it uses exist with their keys (dedup rests on them) and their
columns, and that it may write them; ``require_startup`` turns a FAIL into
ConfigurationError (a refused login: AuthenticationFailed) naming the fix, instead of
logging ``consuming ...`` and failing later. ``Check`` is one line of such a checklist;
``structure`` holds the catalog checks, which ``doctor`` runs too, with its own health
checks on top. Kept below the outbox, the pipeline and the doctor, so that each of them
can call it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, Table
from sqlalchemy import exc as sa_exc

from ..errors import AuthenticationFailed, ConfigurationError
from ..schema import DEFAULT, Tables

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = [
    "FAIL",
    "OK",
    "WARN",
    "Check",
    "failed",
    "require_startup",
    "require_startup_async",
    "startup_checks",
    "startup_checks_async",
]

OK, WARN, FAIL = "ok", "warn", "FAIL"

Unreached = Callable[[Engine, Exception], "Check"]
"""What the checks say of a database they could not reach: a WARN, or raise the error."""


@dataclass(frozen=True)
class Check:
    """One line of the checklist: what was checked, how it stands, what was seen, the fix."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def startup_checks(
    engine: Engine, tables: Tables = DEFAULT, needed: Sequence[Table] | None = None
) -> list[Check]:
    """The cheap part, for a runner or relay at start: reachable, the tables it uses
    (``needed``; default all of ours) present, their keys (dedup rests on them), their
    columns (one missing fails the first statement naming it), rights.

    A database that cannot be reached now is an outage, not a setup fault: it is a WARN
    (``require_startup`` raises it instead, for the runner to wait out); a refused login
    is a FAIL.
    """
    return _startup_checks(engine, tables, needed, _not_reached)


def _startup_checks(
    engine: Engine, tables: Tables, needed: Sequence[Table] | None, unreached: Unreached
) -> list[Check]:
    from . import structure as checks

    found = [checks.engine_settings(engine)]
    try:
        conn = engine.connect()
    except Exception as error:
        return [*found, unreached(engine, error)]
    with conn:
        try:
            return [*found, *_connected_startup_checks(conn, tables, needed)]
        except sa_exc.DBAPIError as error:
            if not _outage(error):
                raise
            return [*found, unreached(engine, error)]


async def startup_checks_async(
    engine: AsyncEngine, tables: Tables = DEFAULT, needed: Sequence[Table] | None = None
) -> list[Check]:
    """``startup_checks`` for an AsyncEngine: the same checks, on one connection, run in
    the sync world through ``run_sync``."""
    return await _startup_checks_async(engine, tables, needed, _not_reached)


async def _startup_checks_async(
    engine: AsyncEngine, tables: Tables, needed: Sequence[Table] | None, unreached: Unreached
) -> list[Check]:
    from . import structure as checks

    found = [checks.engine_settings(engine.sync_engine)]
    try:
        conn = await engine.connect()
    except Exception as error:
        return [*found, unreached(engine.sync_engine, error)]
    try:
        return [*found, *await conn.run_sync(_connected_startup_checks, tables, needed)]
    except sa_exc.DBAPIError as error:
        if not _outage(error):
            raise
        return [*found, unreached(engine.sync_engine, error)]
    finally:
        await conn.close()


def _outage(error: sa_exc.DBAPIError) -> bool:
    """The connection was lost while the checks ran (a killed backend, a restarting server):
    an outage, as a connect() that fails is, not a fault of the setup."""
    return bool(error.connection_invalidated) or isinstance(error, sa_exc.OperationalError)


def _not_reached(engine: Engine, error: Exception) -> Check:
    from ..reasons import authentication_refused
    from . import structure as checks

    said = checks.unreachable(engine, error)
    return said if authentication_refused(error) else replace(said, status=WARN)


def _raise_outage(engine: Engine, error: Exception) -> Check:
    """For ``require_startup``: a refused login stays a FAIL (a setup fault); any other
    failure to reach the database is raised as it came, for the runner to wait out
    (``ConsumerRunner.start_checked``): checks that did not run have not passed."""
    said = _not_reached(engine, error)
    if said.status == FAIL:
        return said
    raise error


def _connected_startup_checks(
    conn: Connection, tables: Tables, needed: Sequence[Table] | None = None
) -> list[Check]:
    from ..db import catalog
    from . import structure as checks

    used = list(tables.owned if needed is None else needed)
    found = [checks.reachable(conn)]
    present = catalog.existing(conn, used)
    if missing := [t.fullname for t in used if t.fullname not in present]:
        found.append(Check("tables", FAIL, f"missing: {', '.join(missing)}", checks.INIT_DB))
    else:
        found.append(Check("tables", OK, ", ".join(t.fullname for t in used)))
    if present:
        found.append(checks.keys(conn, tables, present))
        found.append(checks.columns(conn, tables, present))
        found.append(checks.write_rights(conn, tables, present))
    if conn.in_transaction():
        conn.rollback()
    return found


def failed(found: Sequence[Check]) -> list[Check]:
    return [c for c in found if c.status == FAIL]


def require_startup(
    engine: Engine, tables: Tables = DEFAULT, needed: Sequence[Table] | None = None
) -> None:
    """``startup_checks``, for a runner or relay about to start: ConfigurationError naming
    each FAIL and its fix, instead of logging ``consuming ...`` and failing later. A
    database that cannot be reached raises the driver's error (an outage, to retry)."""
    _require(_startup_checks(engine, tables, needed, _raise_outage))


def _require(found: Sequence[Check]) -> None:
    if bad := failed(found):
        # A refused login is its own error (fatal everywhere, as at the first transaction).
        refused = any(c.name == "database" for c in bad)
        raise (AuthenticationFailed if refused else ConfigurationError)(
            "; ".join(f"{c.name}: {c.detail}" + (f" ({c.fix})" if c.fix else "") for c in bad)
        )


async def require_startup_async(
    engine: AsyncEngine, tables: Tables = DEFAULT, needed: Sequence[Table] | None = None
) -> None:
    """``require_startup`` for an AsyncEngine (``startup_checks_async``)."""
    _require(await _startup_checks_async(engine, tables, needed, _raise_outage))
