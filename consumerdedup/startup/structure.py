"""The deployment's structure: engine settings, the connection, tables, indexes, rights,
the NOTIFY trigger and the schema version. Catalog reads only (``db.catalog``)."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import Connection, Engine, func, insert, inspect, select, text

from ..db import catalog
from ..db.dialects import is_mysql, require_transactional
from ..db.names import table_sql
from ..errors import ConfigurationError
from ..reasons import authentication_refused, describe
from ..schema import (
    AFTER_INSERT_FOR_EACH_STATEMENT,
    NOTIFY_BODY,
    SCHEMA_VERSION,
    Tables,
    installed_version,
    notify_channel_of,
    utcnow,
)
from . import FAIL, OK, WARN, Check

INIT_DB = "run `consumerdedup init-db` (or install()), which makes only what is missing"
_RIGHTS = ("SELECT", "INSERT", "UPDATE", "DELETE")


def engine_settings(engine: Engine) -> Check:
    """AUTOCOMMIT, or a driver whose transaction state cannot be read, breaks every promise."""
    try:
        require_transactional(engine, "the engine")
    except ConfigurationError as error:
        text_, _, fix = str(error).partition("; ")
        return Check("engine", FAIL, text_, fix)
    level = engine.get_execution_options().get("isolation_level") or getattr(
        engine.dialect, "_on_connect_isolation_level", None
    )
    shown = f", isolation {level}" if level else ""
    return Check("engine", OK, f"{engine.dialect.name}+{engine.dialect.driver}{shown}")


def unreachable(engine: Engine, error: Exception) -> Check:
    where = engine.url.render_as_string(hide_password=True)
    if authentication_refused(error):
        fix = "check the user and password in the URL (or create the role, GRANT it LOGIN)"
    else:
        fix = "check the host, port and database name in the URL, and that the server runs"
    return Check("database", FAIL, f"cannot connect to {where}: {describe(error)}", fix)


def reachable(conn: Connection) -> Check:
    if conn.dialect.name == "postgresql":
        user, version = conn.execute(text("SELECT current_user, version()")).one()
        database = conn.execute(text("SELECT current_database()")).scalar_one()
        said = f"connected to {database} as {user} ({' '.join(str(version).split()[:2])})"
    elif conn.dialect.name in ("mysql", "mariadb"):
        user, version, database = conn.execute(
            text("SELECT CURRENT_USER(), VERSION(), DATABASE()")
        ).one()
        said = f"connected to {database} as {user} ({version})"
    else:
        version = conn.execute(text("SELECT sqlite_version()")).scalar_one()
        said = f"connected to {conn.engine.url.database or ':memory:'} (SQLite {version})"
    return Check("database", OK, said)


def tables(conn: Connection, tables: Tables) -> tuple[Check, set[str]]:
    present = catalog.existing(conn, tables.owned)
    missing = [t.fullname for t in tables.owned if t.fullname not in present]
    if missing:
        return Check("tables", FAIL, f"missing: {', '.join(missing)}", INIT_DB), present
    return Check("tables", OK, ", ".join(t.fullname for t in tables.owned)), present


def layout(conn: Connection, tables: Tables, present: set[str]) -> list[Check]:
    """Columns and indexes each present table lacks (a migration may have dropped one)."""
    indexes: list[str] = []
    found = [keys(conn, tables, present), columns(conn, tables, present)]
    for table in tables.owned:
        if table.fullname not in present:
            continue
        indexes += [f"{i.name} on {table.fullname}" for i in catalog.missing_indexes(conn, table)]
    if indexes:
        detail = f"missing, invalid or on other columns: {', '.join(indexes)}"
        found.append(Check("indexes", FAIL, detail, INIT_DB))
    else:
        count = sum(len(t.indexes) for t in tables.owned if t.fullname in present)
        found.append(Check("indexes", OK, f"all {count} present and valid"))
    return found


def columns(conn: Connection, tables: Tables, present: set[str]) -> Check:
    """The columns each present table lacks (made by hand, or by an older release): its
    first statement naming one would fail; then the columns present but not as the
    library writes them (catalog.unwritable_columns), which would fail its first INSERT.
    Doctor and the start checks both run it, once per start."""
    lacking = [
        (table, column)
        for table in tables.owned
        if table.fullname in present
        for column in catalog.missing_columns(conn, table)
    ]
    if not lacking:
        unwritable = [
            f"{table.fullname}.{name} ({wrong})"
            for table in tables.owned
            if table.fullname in present
            for name, wrong in catalog.unwritable_columns(conn, table)
        ]
        if unwritable:
            detail = f"not as the library writes them: {'; '.join(unwritable)}"
            return Check("columns", FAIL, detail, "ALTER TABLE each column as said")
        return Check("columns", OK, "every column present")
    named = ", ".join(f"{table.fullname}.{column.name}" for table, column in lacking)
    fix = INIT_DB
    if hard := [f"{t.fullname}.{c.name}" for t, c in lacking if not catalog.addable(c)]:
        fix = (
            f"apply the release's migration (docs/migrations.md): init-db cannot add "
            f"{', '.join(hard)} (NOT NULL, no default)"
            + ("; run `consumerdedup init-db` for the others" if len(hard) < len(lacking) else "")
        )
    return Check("columns", FAIL, f"missing: {named}", fix)


def keys(conn: Connection, tables: Tables, present: set[str]) -> Check:
    """The primary keys and unique constraints dedup and the outbox rest on: without one,
    two deliveries of a message could both claim it (an effect doubled)."""
    lacking = [
        f"{key} on {table.fullname}"
        for table in tables.owned
        if table.fullname in present
        for key in catalog.missing_keys(conn, table)
    ]
    if lacking:
        fix = "restore it in a migration (docs/migrations.md) before any consumer runs"
        return Check("keys", FAIL, f"missing: {', '.join(lacking)}", fix)
    return Check("keys", OK, "every primary key and unique constraint present")


def write_rights(conn: Connection, tables: Tables, present: set[str]) -> Check:
    """PostgreSQL: has_table_privilege for each right the library uses; SQLite: an INSERT
    into the version table, rolled back (a read-only file or directory refuses it)."""
    if conn.dialect.name != "postgresql":
        return _sqlite_probe(conn, tables, present)
    lacking: dict[str, list[str]] = {}
    statement = text("SELECT has_table_privilege(to_regclass(:t), :r)")
    for table in tables.owned:
        if table.fullname not in present:
            continue
        for right in _RIGHTS:
            if not conn.execute(statement, {"t": table_sql(table), "r": right}).scalar():
                lacking.setdefault(table.fullname, []).append(right)
    user = conn.execute(text("SELECT current_user")).scalar_one()
    if lacking:
        said = "; ".join(f"{', '.join(rights)} on {name}" for name, rights in lacking.items())
        fix = f"GRANT {', '.join(_RIGHTS)} ON {', '.join(lacking)} TO {user}"
        return Check("rights", FAIL, f"{user} lacks {said}", fix)
    return Check("rights", OK, f"{user} may {', '.join(_RIGHTS)} on every table")


def _sqlite_probe(conn: Connection, tables: Tables, present: set[str]) -> Check:
    vt = tables.version_table
    if vt.fullname not in present:
        return Check("rights", WARN, f"not probed: {vt.fullname} is missing", INIT_DB)
    if conn.in_transaction():
        conn.rollback()
    try:
        with conn.begin() as probe:
            row = {"table_name": "doctor probe", "version": 0, "installed_at": utcnow()}
            conn.execute(insert(vt).values(**row))
            probe.rollback()
    except Exception as error:
        fix = "make the database file and its directory writable by this user"
        return Check("rights", FAIL, f"a write was refused: {describe(error)}", fix)
    return Check("rights", OK, "a probe INSERT (rolled back) succeeded")


def notify_trigger(conn: Connection, tables: Tables) -> list[Check]:
    """PostgreSQL: the outbox's trigger, enabled, calling our function, which notifies the
    channel relays listen on (the outbox's OID)."""
    if conn.dialect.name != "postgresql":
        return []
    outbox = tables.outbox
    oid = conn.execute(text("SELECT CAST(to_regclass(:t) AS oid)"), {"t": table_sql(outbox)})
    channel = notify_channel_of(int(oid.scalar_one()))
    trigger_name, function_name = tables.notify_names
    function = catalog.function(conn, outbox.schema, function_name)
    found = catalog.trigger(conn, outbox, trigger_name)
    fix = f"{INIT_DB}; relays poll every poll_interval until then"
    if function is None or found is None:
        what = "trigger" if found is None else "function"
        missing = trigger_name if found is None else f"{function_name}()"
        detail = f"{what} {missing} on {outbox.fullname} is missing: relays are never woken"
        return [Check("notify trigger", FAIL, detail, fix)]
    if function[1] != NOTIFY_BODY:
        detail = f"{function_name}() does not notify {channel}, the channel relays listen on"
        return [Check("notify trigger", FAIL, detail, fix)]
    expected = catalog.Trigger(function[0], AFTER_INSERT_FOR_EACH_STATEMENT, "O", 0, False)
    if found not in (expected, replace(expected, enabled="A")):
        if found.function != function[0]:  # ours by name, calling another function
            state = f"calling another function, not {function_name}()"
        elif found.enabled == "D":
            state = "disabled"
        else:
            state = "not AFTER INSERT FOR EACH STATEMENT"
        return [Check("notify trigger", FAIL, f"{trigger_name} is {state}", fix)]
    return [Check("notify trigger", OK, f"{trigger_name} notifies {channel}")]


def mysql_outbox(conn: Connection, tables: Tables) -> list[Check]:
    """MySQL/MariaDB: the outbox's key-lock table with every bucket row (``Outbox.add``
    row-locks its key's bucket there: without the table every add fails, without a row an
    add of that bucket's keys is refused) and the relay's scan indexes (without them every
    relay round reads the whole outbox)."""
    if not is_mysql(conn.dialect):
        return []
    from ..schema.mysql_outbox import BUCKETS, key_locks_table, relay_indexes

    table = key_locks_table(tables.outbox)
    if table.fullname not in catalog.existing(conn, [table]):
        detail = (
            f"{table.fullname} is missing: every Outbox.add fails (it locks its key's bucket "
            "there, so a key's events commit in order)"
        )
        return [Check("outbox key locks", FAIL, detail, INIT_DB)]
    bucket = table.c.bucket
    have = conn.execute(
        select(func.count()).select_from(table).where(bucket >= 0, bucket < BUCKETS)
    ).scalar_one()
    if have < BUCKETS:
        detail = (
            f"{table.fullname} has {have} of its {BUCKETS} bucket rows: Outbox.add is "
            "refused for the keys of a missing bucket"
        )
        return [Check("outbox key locks", FAIL, detail, INIT_DB)]
    found = [Check("outbox key locks", OK, f"{table.fullname}: all {BUCKETS} bucket rows")]
    outbox = tables.outbox
    names = {index["name"] for index in inspect(conn).get_indexes(outbox.name, outbox.schema)}
    lacking = [str(index.name) for index in relay_indexes(outbox) if index.name not in names]
    if lacking:
        detail = (
            f"{', '.join(lacking)} missing on {outbox.fullname}: every relay round reads "
            "the whole outbox"
        )
        found.append(Check("relay indexes", WARN, detail, INIT_DB))
    else:
        found.append(Check("relay indexes", OK, f"{len(relay_indexes(outbox))} present"))
    return found


def schema_version(conn: Connection, tables: Tables, present: set[str]) -> Check:
    if tables.version_table.fullname not in present:
        return Check("schema version", FAIL, "no version recorded", INIT_DB)
    version = installed_version(conn, tables)
    if version is None:
        detail = f"not recorded for every table (this release: {SCHEMA_VERSION})"
        return Check("schema version", WARN, detail, INIT_DB)
    if version < SCHEMA_VERSION:
        detail = f"{version}, older than this release's {SCHEMA_VERSION}"
        fix = "apply this release's migration (docs/migrations.md), or run init-db"
        return Check("schema version", FAIL, detail, fix)
    if version > SCHEMA_VERSION:
        detail = f"{version}, newer than this release's {SCHEMA_VERSION} (a rolling deploy?)"
        return Check("schema version", WARN, detail, "upgrade consumerdedup on this host")
    return Check("schema version", OK, f"{version}, this release's")
