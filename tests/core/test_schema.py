"""The library's tables: validated names, user metadata, idempotent install, DDL, keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.orm import Session

from consumerdedup import ConfigurationError, Deduplicator, Message, Outcome, Tables, install
from consumerdedup.schema import ddl
from tests.conftest import Database

LONGEST = "x" * 63


@pytest.fixture
def sqlite_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'schema.db'}")
    yield engine
    engine.dispose()


def now() -> datetime:
    return datetime.now(UTC)


def processed_row(consumer: str, message_id: str) -> dict[str, Any]:
    return {
        "consumer": consumer,
        "message_id": message_id,
        "processed_at": now(),
        "payload_hash": "0" * 64,
        "outcome": "processed",
    }


def outbox_row(event_id: str) -> dict[str, Any]:
    return {
        "event_id": event_id,
        "destination": "payments",
        "body": b"{}",
        "headers": {"event_id": event_id},
        "created_at": now(),
        "available_at": now(),
    }


# Names


BAD_NAMES: list[Any] = [
    "1abc",
    "a-b",
    "x;drop",
    "a.b.c",
    "",
    "a.",
    ".a",
    "a b",
    'a"b',
    "x" * 64,
    f"s.{'x' * 64}",
    f"{'x' * 64}.t",
    None,
    42,
    b"processed_events",
]


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_processed_events_name_is_a_configuration_error(name: Any) -> None:
    with pytest.raises(ConfigurationError, match="expected a table name") as caught:
        Tables.define(processed_events=name)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("name", BAD_NAMES, ids=repr)
def test_bad_outbox_name_is_a_configuration_error(name: Any) -> None:
    with pytest.raises(ValueError, match="expected a table name") as caught:
        Tables.define(outbox=name)
    assert isinstance(caught.value, ConfigurationError)


def test_good_names_are_accepted() -> None:
    tables = Tables.define("_seen_2", LONGEST)
    assert (tables.processed_events.schema, tables.processed_events.name) == (None, "_seen_2")
    assert tables.outbox.name == LONGEST


def test_schema_qualified_name_sets_the_schema() -> None:
    tables = Tables.define("s.t", "other.box")
    assert tables.processed_events.schema == "s"
    assert tables.processed_events.name == "t"
    assert tables.processed_events.fullname == "s.t"
    assert (tables.outbox.schema, tables.outbox.name) == ("other", "box")


def test_trailing_newline_is_rejected() -> None:
    with pytest.raises(ConfigurationError):
        Tables.define(processed_events="processed_events\n")


def test_every_name_define_accepts_installs_on_postgresql(
    pg_engine: Engine, pg_schema: str
) -> None:
    tables = Tables.define(f"{pg_schema}.{LONGEST}", f"{pg_schema}.{'y' * 63}")
    install(pg_engine, tables)
    names = set(inspect(pg_engine).get_table_names(schema=pg_schema))
    assert names == {
        LONGEST,
        "y" * 63,
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


# The user's own MetaData (what Alembic autogenerate compares against)


def test_define_onto_the_users_metadata(sqlite_engine: Engine) -> None:
    metadata = MetaData()
    Table("orders", metadata, Column("id", Integer, primary_key=True), Column("note", String(20)))
    tables = Tables.define("dedup_seen", "dedup_outbox", metadata=metadata)

    assert tables.metadata is metadata
    assert set(metadata.tables) == {
        "orders",
        "dedup_seen",
        "dedup_outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }
    assert metadata.tables["dedup_seen"] is tables.processed_events
    assert metadata.tables["dedup_outbox"] is tables.outbox
    # The user's create_all (or migration) builds the library's tables with their own.
    metadata.create_all(sqlite_engine)
    assert set(inspect(sqlite_engine).get_table_names()) == {
        "orders",
        "dedup_seen",
        "dedup_outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


def test_default_tables_do_not_land_in_a_users_metadata() -> None:
    metadata = MetaData()
    Tables.define(metadata=metadata)
    Tables.define()  # another, private MetaData
    assert set(metadata.tables) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


# install


def test_install_twice_on_sqlite_is_harmless(sqlite_engine: Engine) -> None:
    tables = Tables.define()
    install(sqlite_engine, tables)
    with sqlite_engine.begin() as conn:
        conn.execute(insert(tables.processed_events), processed_row("c", "m-1"))
        conn.execute(insert(tables.outbox), outbox_row("e-1"))
    install(sqlite_engine, tables)
    with sqlite_engine.connect() as conn:
        assert conn.execute(select(tables.processed_events.c.message_id)).scalars().all() == ["m-1"]
        assert conn.execute(select(tables.outbox.c.event_id)).scalars().all() == ["e-1"]


def test_install_twice_on_postgresql_creates_the_schema_and_keeps_data(
    pg_engine: Engine, pg_schema: str
) -> None:
    tables = Tables.define(f"{pg_schema}.processed_events", f"{pg_schema}.outbox")
    assert pg_schema not in inspect(pg_engine).get_schema_names()
    install(pg_engine, tables)
    assert pg_schema in inspect(pg_engine).get_schema_names()
    assert set(inspect(pg_engine).get_table_names(schema=pg_schema)) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }
    with pg_engine.begin() as conn:
        conn.execute(insert(tables.processed_events), processed_row("c", "m-1"))
        conn.execute(insert(tables.outbox), outbox_row("e-1"))
    install(pg_engine, tables)
    with pg_engine.connect() as conn:
        assert conn.execute(select(tables.processed_events.c.message_id)).scalars().all() == ["m-1"]
        assert conn.execute(select(tables.outbox.c.event_id)).scalars().all() == ["e-1"]


def test_install_on_a_connection_joins_its_transaction(pg_engine: Engine, pg_schema: str) -> None:
    tables = Tables.define(f"{pg_schema}.processed_events", f"{pg_schema}.outbox")
    with pg_engine.connect() as conn:
        install(conn, tables)
        assert set(inspect(conn).get_table_names(schema=pg_schema)) == {
            "processed_events",
            "outbox",
            "idempotency_keys",
            "consumer_offsets",
            "consumerdedup_schema",
        }
        conn.rollback()
    assert pg_schema not in inspect(pg_engine).get_schema_names()  # rolled back with it
    with pg_engine.begin() as conn:
        install(conn, tables)
        install(conn, tables)
    assert set(inspect(pg_engine).get_table_names(schema=pg_schema)) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


def test_install_on_a_sqlite_connection(sqlite_engine: Engine) -> None:
    tables = Tables.define("seen", "out")
    with sqlite_engine.begin() as conn:
        install(conn, tables)
        conn.execute(insert(tables.processed_events), processed_row("c", "m-1"))
    assert set(inspect(sqlite_engine).get_table_names()) == {
        "seen",
        "out",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


def test_custom_table_names_work_end_to_end(db: Database) -> None:
    ledger = db.create_ledger()
    custom = Tables.define(db.name("inbox_seen"), db.name("events_out"))
    install(db.engine, custom)
    dedup = Deduplicator(db.engine, consumer="c", tables=custom)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        data = message.json()
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES (:a, :n, :m)"),
            {"a": data["account"], "n": data["amount"], "m": message.id},
        )

    message = Message(id="p-1", body=json.dumps({"account": "alice", "amount": 5}).encode())
    assert handle(message) is Outcome.PROCESSED
    assert handle(message) is Outcome.DUPLICATE

    seen = custom.processed_events
    with db.engine.connect() as conn:
        assert conn.execute(select(seen.c.consumer, seen.c.message_id, seen.c.outcome)).all() == [
            ("c", "p-1", "processed")
        ]
        default_rows = conn.execute(select(db.tables.processed_events)).all()
    assert default_rows == []  # nothing went to the fixture's default-named table
    assert db.scalar(f"SELECT count(*) FROM {ledger}") == 1


# ddl


def test_ddl_lists_both_tables_and_the_processed_at_index(sqlite_engine: Engine) -> None:
    sql = ddl(sqlite_engine, Tables.define())
    assert "CREATE TABLE processed_events" in sql
    assert "CREATE TABLE outbox" in sql
    assert "CREATE INDEX ix_processed_events_processed_at ON processed_events (processed_at)" in sql
    assert "CREATE SCHEMA" not in sql


def test_ddl_on_postgresql_creates_the_schema_first_and_runs_as_printed(
    pg_engine: Engine, pg_schema: str
) -> None:
    tables = Tables.define(f"{pg_schema}.seen", f"{pg_schema}.out")
    sql = ddl(pg_engine, tables)
    statements = [s for s in sql.split(";\n") if s.strip()]
    assert statements[0] == f'CREATE SCHEMA IF NOT EXISTS "{pg_schema}"'
    assert f"CREATE TABLE {pg_schema}.seen" in sql
    assert f"CREATE TABLE {pg_schema}.out" in sql
    assert f"CREATE INDEX ix_seen_processed_at ON {pg_schema}.seen (processed_at)" in sql
    # What --sql prints is what install would do: running it gives working tables.
    with pg_engine.begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
        conn.execute(insert(tables.processed_events), processed_row("c", "m-1"))
    assert set(inspect(pg_engine).get_table_names(schema=pg_schema)) == {
        "seen",
        "out",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


def test_ddl_on_sqlite_runs_as_printed(sqlite_engine: Engine) -> None:
    tables = Tables.define()
    with sqlite_engine.begin() as conn:
        for statement in ddl(sqlite_engine, tables).split(";\n"):
            if statement.strip():
                conn.exec_driver_sql(statement)
        conn.execute(insert(tables.outbox), outbox_row("e-1"))
        assert conn.execute(select(tables.outbox.c.id)).scalar_one() == 1
    assert set(inspect(sqlite_engine).get_table_names()) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }


# Keys and indexes, as the database reports them


def test_processed_events_key_and_index(db: Database) -> None:
    pe = db.tables.processed_events
    inspector = inspect(db.engine)
    pk = inspector.get_pk_constraint(pe.name, schema=db.schema)
    assert pk["constrained_columns"] == ["consumer", "message_id"]
    indexed = {tuple(i["column_names"]) for i in inspector.get_indexes(pe.name, schema=db.schema)}
    assert ("processed_at",) in indexed

    with db.engine.begin() as conn:
        conn.execute(insert(pe), processed_row("a", "m-1"))
        conn.execute(insert(pe), processed_row("b", "m-1"))  # same id, other consumer: fine
    with pytest.raises(sqlalchemy.exc.IntegrityError), db.engine.begin() as conn:
        conn.execute(insert(pe), processed_row("a", "m-1"))
    assert db.scalar(f"SELECT count(*) FROM {pe.fullname}") == 2


def test_outbox_event_id_is_unique(db: Database) -> None:
    ob = db.tables.outbox
    uniques = inspect(db.engine).get_unique_constraints(ob.name, schema=db.schema)
    assert ["event_id"] in [u["column_names"] for u in uniques]

    with db.engine.begin() as conn:
        first = conn.execute(insert(ob).returning(ob.c.id), outbox_row("e-1")).scalar_one()
        second = conn.execute(insert(ob).returning(ob.c.id), outbox_row("e-2")).scalar_one()
    assert second > first  # identity ids give the publication order
    with pytest.raises(sqlalchemy.exc.IntegrityError), db.engine.begin() as conn:
        conn.execute(insert(ob), outbox_row("e-1"))
    assert db.scalar(f"SELECT count(*) FROM {ob.fullname}") == 2


def test_defining_the_same_names_twice_on_one_metadata_is_a_configuration_error() -> None:
    metadata = MetaData()
    Tables.define(metadata=metadata)
    with pytest.raises(ConfigurationError, match="already defined"):
        Tables.define(metadata=metadata)
