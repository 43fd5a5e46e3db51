"""install() on a database that has everything reads the catalog only: no change, no lock.

Against the real PostgreSQL (and SQLite): a second install() sends nothing but
SELECTs (it runs in a READ ONLY transaction) and leaves every catalog row as it
was (xmin included, so even an identical CREATE OR REPLACE would show); it
returns at once while another session holds an open outbox INSERT; what was
dropped (an index, the trigger, the DEFAULT partition) is made again; a change
that needs a lock someone holds fails fast naming the table. And the schema
version install() records, read by installed_version().
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, delete, event, insert, text, update

from consumerdedup import ConfigurationError, Tables, install
from consumerdedup.schema import SCHEMA_VERSION, SchemaLocked, installed_version

WAIT_LIMIT = 15.0
"""Seconds an install() that should not wait may take; the sessions' own lock_timeout
and statement_timeout (``GUARD``, 30 s) make a regression fail instead of hanging. A
regression that waits on the held lock waits out the whole 30 s, twice the limit: the
limit is a generous bound, not a race with the machine's load (it was 3 s against 5 s)."""
GUARD = "30s"


@pytest.fixture
def schema(pg_schema: str) -> str:
    """A schema of this test's own (the install makes it)."""
    return pg_schema


def pg_tables(schema: str, partitioned: bool = False) -> Tables:
    return Tables.define(f"{schema}.processed_events", f"{schema}.outbox", partitioned=partitioned)


def bounded(conn: Connection) -> None:
    """This session waits at most 30 s for a lock or a statement: a hang is a failure."""
    conn.exec_driver_sql(f"SET lock_timeout = '{GUARD}'")
    conn.exec_driver_sql(f"SET statement_timeout = '{GUARD}'")


def snapshot(conn: Connection, schema: str) -> dict[str, Any]:
    """Every catalog row of the schema's objects, with xmin: a rewrite shows."""
    ns = {"s": schema}
    queries = {
        "relations": "SELECT c.relname, c.relkind, c.xmin::text FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s",
        "indexes": "SELECT i.indexrelid::regclass::text, i.indisvalid, i.xmin::text "
        "FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s",
        "triggers": "SELECT t.tgname, t.tgfoid, t.tgenabled, t.xmin::text FROM pg_trigger t "
        "JOIN pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s",
        "functions": "SELECT p.proname, p.prosrc, p.xmin::text FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = :s",
        "versions": "SELECT table_name, version, installed_at "
        f'FROM "{schema}".consumerdedup_schema',
    }
    return {
        name: sorted(tuple(row) for row in conn.execute(text(sql), ns))
        for name, sql in queries.items()
    }


class Statements:
    """The SQL an engine sends, recorded while the context is open."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sent: list[str] = []

    def _record(self, *args: Any) -> None:
        self.sent.append(" ".join(str(args[2]).split()))

    def __enter__(self) -> Statements:
        event.listen(self.engine, "before_cursor_execute", self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._record)

    def changes(self) -> list[str]:
        """What is not a read (SELECT, or a PRAGMA read on SQLite). SQLite's BEGIN IMMEDIATE
        is install()'s write lock, one install at a time (it changes nothing)."""
        reads = ("SELECT", "PRAGMA", "BEGIN IMMEDIATE")
        return [s for s in self.sent if not s.upper().startswith(reads)]


def outbox_row(event_id: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    return {
        "event_id": event_id,
        "destination": "d",
        "body": b"{}",
        "headers": {},
        "created_at": now,
        "available_at": now,
    }


@pytest.fixture
def holder(pg_engine: Engine) -> Iterator[Connection]:
    """Another session, for a test to leave inside an open transaction."""
    with pg_engine.connect() as conn:
        bounded(conn)
        yield conn
        conn.rollback()


# An up-to-date database: reads only


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
def test_install_twice_sends_only_reads_and_changes_nothing(
    pg_engine: Engine, schema: str, partitioned: bool
) -> None:
    tables = pg_tables(schema, partitioned)
    install(pg_engine, tables)
    with pg_engine.connect() as conn:
        before = snapshot(conn, schema)
    with pg_engine.connect() as conn, Statements(pg_engine) as statements:
        bounded(conn)
        conn.commit()
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")  # a write of any kind fails here
        install(conn, tables)
        conn.rollback()
    assert statements.changes() == [
        f"SET lock_timeout = '{GUARD}'",
        f"SET statement_timeout = '{GUARD}'",
        "SET TRANSACTION READ ONLY",
    ]
    with pg_engine.connect() as conn:
        assert snapshot(conn, schema) == before


@pytest.mark.parametrize("partitioned", [False, True], ids=["plain", "partitioned"])
def test_install_while_an_outbox_insert_is_open_returns_at_once(
    pg_engine: Engine, schema: str, holder: Connection, partitioned: bool
) -> None:
    tables = pg_tables(schema, partitioned)
    install(pg_engine, tables)
    with pg_engine.connect() as conn:
        before = snapshot(conn, schema)
    holder.execute(insert(tables.outbox), outbox_row("held"))  # uncommitted: ROW EXCLUSIVE
    now = datetime.now(UTC)
    claim = {"consumer": "c", "message_id": "m", "processed_at": now}
    holder.execute(insert(tables.processed_events), {**claim, "payload_hash": "0", "outcome": "p"})

    with pg_engine.connect() as conn:
        bounded(conn)
        conn.commit()
        started = time.monotonic()
        with conn.begin():
            install(conn, tables)  # before: DROP TRIGGER waited on the holder, then 55P03
        took = time.monotonic() - started
        assert snapshot(conn, schema) == before
    assert took < WAIT_LIMIT
    # The holder was not disturbed either: its insert commits.
    holder.commit()
    with pg_engine.connect() as conn:
        assert conn.execute(text(f'SELECT count(*) FROM "{schema}".outbox')).scalar() == 1


def test_install_twice_on_sqlite_sends_only_reads(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'i.db'}")
    tables = Tables.define()
    install(engine, tables)
    dump = _sqlite_schema(engine)
    with Statements(engine) as statements:
        install(engine, tables)
    assert statements.sent  # it did look
    assert statements.changes() == []
    assert _sqlite_schema(engine) == dump
    engine.dispose()


def _sqlite_schema(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text("SELECT * FROM sqlite_master ORDER BY name"))]


# What is missing or different is made again


def test_a_dropped_index_is_made_again(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP INDEX "{schema}".ix_outbox_unpublished'))
        conn.execute(text(f'DROP INDEX "{schema}".ix_processed_events_processed_at'))
    with Statements(pg_engine) as statements:
        install(pg_engine, tables)
    made = [s for s in statements.changes() if s.startswith("CREATE INDEX")]
    assert len(made) == 2, statements.changes()
    with pg_engine.connect() as conn:
        names = {row[0] for row in snapshot(conn, schema)["indexes"]}
    assert f"{schema}.ix_outbox_unpublished" in names
    assert f"{schema}.ix_processed_events_processed_at" in names


@pytest.mark.parametrize("kind", ["postgresql", "sqlite"])
def test_a_column_an_older_release_lacked_is_added(
    kind: str, pg_engine: Engine, schema: str, tmp_path: Path
) -> None:
    """Tables made by an older layout: install() adds the nullable columns it lacks."""
    if kind == "sqlite":
        engine, tables = create_engine(f"sqlite:///{tmp_path / 'c.db'}"), Tables.define()
    else:
        engine, tables = pg_engine, pg_tables(schema)
    install(engine, tables)
    outbox = tables.outbox.fullname
    with engine.begin() as conn:
        conn.execute(insert(tables.outbox), outbox_row("old"))
        conn.execute(text(f"ALTER TABLE {outbox} DROP COLUMN last_error"))
    with Statements(engine) as statements:
        install(engine, tables)
    assert [s for s in statements.changes() if s.startswith("ALTER")] == [
        f"ALTER TABLE {outbox} ADD COLUMN last_error TEXT"
    ]
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT event_id, last_error FROM {outbox}")).all() == [
            ("old", None)
        ]


def test_a_not_null_column_missing_is_a_clear_error(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {tables.outbox.fullname} DROP COLUMN destination"))
    with pytest.raises(ConfigurationError, match=r"outbox lacks column destination.*migration"):
        install(pg_engine, tables)


def test_a_dropped_index_on_sqlite_is_made_again(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'i.db'}")
    tables = Tables.define()
    install(engine, tables)
    with engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_outbox_failing"))
    install(engine, tables)
    with engine.connect() as conn:
        found = conn.execute(
            text("SELECT count(*) FROM sqlite_master WHERE name = 'ix_outbox_failing'")
        ).scalar()
    assert found == 1
    engine.dispose()


def test_a_dropped_trigger_is_made_again_and_notifies(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP TRIGGER outbox_notify ON "{schema}".outbox'))
    with Statements(pg_engine) as statements:
        install(pg_engine, tables)
    assert [s for s in statements.changes() if "TRIGGER" in s] == [tables.create_trigger_sql()]
    assert not [s for s in statements.changes() if "REPLACE FUNCTION" in s]  # it was fine
    _assert_notifies(pg_engine, tables)


def test_an_old_function_body_is_replaced_and_the_trigger_kept(
    pg_engine: Engine, schema: str
) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:  # an earlier release's body: the channel by name
        conn.execute(
            text(
                f'CREATE OR REPLACE FUNCTION "{schema}".outbox_notify() RETURNS trigger '
                "LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('old', ''); RETURN NULL; END $$"
            )
        )
        trigger_before = snapshot(conn, schema)["triggers"]
    with Statements(pg_engine) as statements:
        install(pg_engine, tables)
    assert [s for s in statements.changes() if "FUNCTION" in s] == [tables.notify_function_sql()]
    with pg_engine.connect() as conn:
        assert snapshot(conn, schema)["triggers"] == trigger_before  # not dropped, not made
    _assert_notifies(pg_engine, tables)


def test_a_newer_releases_trigger_function_is_left_alone(pg_engine: Engine, schema: str) -> None:
    """Rolling deploy: the newer release installed first; an older instance's install()
    must not put its own body back (they would replace each other at every start)."""
    tables = pg_tables(schema)
    install(pg_engine, tables)
    vt = tables.version_table
    with pg_engine.begin() as conn:
        conn.execute(update(vt).values(version=SCHEMA_VERSION + 1))
        conn.execute(
            text(
                f'CREATE OR REPLACE FUNCTION "{schema}".outbox_notify() RETURNS trigger '
                "LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_notify('next', ''); RETURN NULL; END $$"
            )
        )
        before = snapshot(conn, schema)
    with Statements(pg_engine) as statements:
        install(pg_engine, tables)
    assert statements.changes() == []
    with pg_engine.connect() as conn:
        assert snapshot(conn, schema) == before


def test_a_row_level_trigger_of_that_name_is_replaced(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP TRIGGER outbox_notify ON "{schema}".outbox'))
        conn.execute(
            text(
                f'CREATE TRIGGER outbox_notify AFTER INSERT ON "{schema}".outbox '
                f'FOR EACH ROW EXECUTE FUNCTION "{schema}".outbox_notify()'
            )
        )
    with Statements(pg_engine) as statements:
        install(pg_engine, tables)
    assert [s for s in statements.changes() if "TRIGGER" in s] == [
        tables.drop_trigger_sql(),
        tables.create_trigger_sql(),
    ]
    with pg_engine.connect() as conn:
        [(_, _, enabled, _)] = snapshot(conn, schema)["triggers"]
        tgtype = conn.execute(
            text(f"SELECT tgtype FROM pg_trigger WHERE tgrelid = '\"{schema}\".outbox'::regclass")
        ).scalar()
    assert (enabled, tgtype) == ("O", 4)  # AFTER INSERT FOR EACH STATEMENT


def test_a_dropped_default_partition_is_made_again(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema, partitioned=True)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP TABLE "{schema}".processed_events_default'))
    install(pg_engine, tables)
    with pg_engine.connect() as conn:
        relations = {row[0] for row in snapshot(conn, schema)["relations"]}
    assert "processed_events_default" in relations


def test_a_change_that_needs_a_held_lock_fails_fast_naming_the_table(
    pg_engine: Engine, schema: str, holder: Connection
) -> None:
    tables = pg_tables(schema)
    install(pg_engine, tables)
    with pg_engine.begin() as conn:
        conn.execute(text(f'DROP TRIGGER outbox_notify ON "{schema}".outbox'))
    holder.execute(insert(tables.outbox), outbox_row("held"))
    with pg_engine.connect() as conn:
        bounded(conn)
        started = time.monotonic()
        with pytest.raises(SchemaLocked) as caught:
            install(conn, tables)
        took = time.monotonic() - started
    assert took < WAIT_LIMIT
    message = str(caught.value)
    assert f"{schema}.outbox" in message
    assert "NOTIFY trigger" in message
    assert "consumerdedup init-db" in message
    holder.rollback()
    install(pg_engine, tables)  # nobody holds it now
    _assert_notifies(pg_engine, tables)


def _assert_notifies(engine: Engine, tables: Tables) -> None:
    """An outbox INSERT wakes a listener on the OID channel once committed."""
    import psycopg

    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as listener:
        oid = listener.execute(
            "SELECT CAST(CAST(%s AS regclass) AS oid)", (tables.outbox.fullname,)
        ).fetchone()
        assert oid is not None
        listener.execute(f'LISTEN "consumerdedup_{oid[0]}"')
        with engine.begin() as conn:
            conn.execute(insert(tables.outbox), outbox_row(uuid.uuid4().hex))
        assert [n.channel for n in listener.notifies(timeout=5, stop_after=1)] == [
            f"consumerdedup_{oid[0]}"
        ]


# The schema version


def test_installed_version_on_postgresql(pg_engine: Engine, schema: str) -> None:
    tables = pg_tables(schema)
    with pg_engine.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    assert installed_version(pg_engine, tables) is None  # nothing installed
    install(pg_engine, tables)
    assert installed_version(pg_engine, tables) == SCHEMA_VERSION
    _version_lifecycle(pg_engine, tables)


def test_installed_version_on_sqlite(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'v.db'}")
    tables = Tables.define("seen", "out")
    assert installed_version(engine, tables) is None
    install(engine, tables)
    assert installed_version(engine, tables) == SCHEMA_VERSION
    _version_lifecycle(engine, tables)
    # Another set of tables in the same database has rows of its own.
    other = Tables.define("seen2", "out2", idempotency_keys="keys2")
    assert installed_version(engine, other) is None
    install(engine, other)
    assert installed_version(engine, other) == SCHEMA_VERSION
    engine.dispose()


def _version_lifecycle(engine: Engine, tables: Tables) -> None:
    vt = tables.version_table
    with engine.connect() as conn:
        rows = conn.execute(vt.select().order_by(vt.c.table_name)).all()
    assert sorted(r.table_name for r in rows) == sorted(t.fullname for t in tables.all)
    # Tables made by a release before versions: a row missing is no version; install adds it.
    with engine.begin() as conn:
        conn.execute(delete(vt).where(vt.c.table_name == tables.outbox.fullname))
    assert installed_version(engine, tables) is None
    install(engine, tables)
    assert installed_version(engine, tables) == SCHEMA_VERSION
    # An older row is raised; a newer release's row (a rolling deploy) is left alone.
    with engine.begin() as conn:
        conn.execute(update(vt).values(version=SCHEMA_VERSION + 5))
        conn.execute(update(vt).where(vt.c.table_name == tables.outbox.fullname).values(version=0))
    assert installed_version(engine, tables) == 0
    install(engine, tables)
    with engine.connect() as conn:
        versions = {r.table_name: r.version for r in conn.execute(vt.select())}
    assert versions[tables.outbox.fullname] == SCHEMA_VERSION
    assert versions[tables.processed_events.fullname] == SCHEMA_VERSION + 5
    assert installed_version(engine, tables) == SCHEMA_VERSION
