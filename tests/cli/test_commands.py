"""The ``consumerdedup`` command, run for real in a subprocess (``python -m consumerdedup``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import create_engine, insert, inspect, text
from sqlalchemy.engine import make_url

from consumerdedup import Tables
from tests.support import mariadb_service

ROOT = Path(__file__).resolve().parents[2]
UNREACHABLE = "postgresql://alice:s3cr3tpw@127.0.0.1:1/x"


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def err_lines(self) -> list[str]:
        return self.err.splitlines()

    def assert_one_line_error(self, code: int, *secrets: str) -> None:
        assert self.code == code, (self.code, self.out, self.err)
        assert len(self.err_lines) == 1, self.err
        assert self.err.startswith("consumerdedup: error: ")
        assert "Traceback" not in self.err
        self.assert_hides(*secrets)

    def assert_hides(self, *secrets: str) -> None:
        for secret in secrets:
            assert secret not in self.out
            assert secret not in self.err


def cli(*args: str, env: dict[str, str] | None = None) -> Run:
    environ = {k: v for k, v in os.environ.items() if k != "CONSUMERDEDUP_DB_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "consumerdedup", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**environ, **(env or {})},
        timeout=120,
    )
    return Run(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'cli.db'}"


@dataclass
class PgTarget:
    url: str
    schema: str

    @property
    def options(self) -> list[str]:
        return [
            "--db",
            self.url,
            "--processed-events-table",
            f"{self.schema}.processed_events",
            "--outbox-table",
            f"{self.schema}.outbox",
        ]


@pytest.fixture
def pg_target(postgres_url: str) -> Iterator[PgTarget]:
    """A schema of its own (created by the command under test), dropped afterwards."""
    schema = f"s_{uuid.uuid4().hex[:12]}"
    yield PgTarget(postgres_url, schema)
    engine = create_engine(postgres_url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    engine.dispose()


@pytest.fixture
def my_target(mariadb_url: str) -> Iterator[PgTarget]:
    """MariaDB: a database of its own (a MySQL schema), empty, dropped afterwards."""
    with mariadb_service.isolated_database(mariadb_url) as name:
        yield PgTarget(mariadb_service.in_database(mariadb_url, name), name)


def table_names(url: str, schema: str | None = None) -> set[str]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names(schema=schema))
    finally:
        engine.dispose()


# --- init-db ---------------------------------------------------------------------------------


def test_init_db_twice_on_sqlite(sqlite_url: str) -> None:
    first = cli("init-db", "--db", sqlite_url)
    assert first.code == 0, first.err
    assert "created" in first.out
    assert {"processed_events", "outbox"} <= table_names(sqlite_url)

    second = cli("init-db", "--db", sqlite_url)
    assert second.code == 0, second.err
    assert "already present" in second.out
    assert "created" not in second.out
    assert second.err == ""


@pytest.mark.postgres
def test_init_db_twice_on_postgres(pg_target: PgTarget) -> None:
    first = cli("init-db", *pg_target.options)
    assert first.code == 0, first.err
    assert "created" in first.out
    assert table_names(pg_target.url, pg_target.schema) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",  # the schema version install() records
    }

    second = cli("init-db", *pg_target.options)
    assert second.code == 0, second.err
    assert "already present" in second.out
    assert table_names(pg_target.url, pg_target.schema) == {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",  # the schema version install() records
    }


def test_init_db_twice_on_mariadb(my_target: PgTarget) -> None:
    first = cli("init-db", *my_target.options)
    assert first.code == 0, first.err
    assert "created" in first.out
    expected = {
        "processed_events",
        "outbox",
        "idempotency_keys",
        "consumer_offsets",
        "consumerdedup_schema",
    }
    assert expected <= table_names(my_target.url, my_target.schema)
    second = cli("init-db", *my_target.options)
    assert second.code == 0, second.err
    assert "already present" in second.out and "created" not in second.out
    doctor = cli("doctor", *my_target.options)
    assert doctor.code == 0, doctor.out + doctor.err
    assert "every primary key and unique constraint present" in doctor.out


def test_doctor_on_mariadb_checks_the_outbox_key_lock_table(my_target: PgTarget) -> None:
    """Outbox.add row-locks its key's bucket in <outbox>_key_locks: doctor fails, naming the
    table and init-db, when the table or a bucket row is missing; a missing relay index
    is a warn (every relay round reads the whole outbox)."""

    def checks() -> tuple[int, dict[str, dict[str, str]]]:
        run = cli("doctor", "--json", *my_target.options)
        return run.code, {c["name"]: c for c in json.loads(run.out)["checks"]}

    assert cli("init-db", *my_target.options).code == 0
    code, found = checks()
    assert code == 0 and found["outbox key locks"]["status"] == "ok", found
    assert found["relay indexes"]["status"] == "ok", found
    locks = f"{my_target.schema}.outbox_key_locks"
    engine = create_engine(my_target.url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"DROP INDEX ix_outbox_relay_scan ON {my_target.schema}.outbox"))
        code, found = checks()
        assert code == 0 and found["relay indexes"]["status"] == "warn", found  # slower only
        assert "ix_outbox_relay_scan missing" in found["relay indexes"]["detail"]
        with engine.begin() as conn:
            conn.execute(text(f"DELETE FROM {locks} WHERE bucket >= 4000"))
        code, found = checks()
        assert code == 1, found
        assert found["outbox key locks"]["status"] == "FAIL"
        assert "has 4000 of its 4096 bucket rows" in found["outbox key locks"]["detail"]
        with engine.begin() as conn:
            conn.execute(text(f"DROP TABLE {locks}"))
        code, found = checks()
        assert code == 1 and found["outbox key locks"]["status"] == "FAIL", found
        detail, fix = found["outbox key locks"]["detail"], found["outbox key locks"]["fix"]
        assert detail.startswith(f"{locks} is missing: every Outbox.add fails"), detail
        assert "consumerdedup init-db" in fix
        assert cli("init-db", *my_target.options).code == 0  # the fix it names
        code, found = checks()
        assert code == 0 and found["outbox key locks"]["status"] == "ok", found
        assert found["relay indexes"]["status"] == "ok", found
    finally:
        engine.dispose()


def test_bare_mysql_url_uses_pymysql(my_target: PgTarget) -> None:
    options = my_target.options
    options[1] = options[1].replace("mysql+pymysql://", "mysql://")
    run = cli("init-db", *options)
    assert run.code == 0, run.err
    assert "mysql+pymysql://" in run.out


@pytest.mark.postgres
def test_bare_postgresql_url_uses_psycopg_and_masks_the_password(pg_target: PgTarget) -> None:
    url = make_url(pg_target.url).set(drivername="postgresql", password="tRustMe42")
    options = pg_target.options
    options[1] = url.render_as_string(hide_password=False)  # trust auth ignores the password
    run = cli("init-db", *options)
    assert run.code == 0, run.err
    assert "postgresql+psycopg://" in run.out
    assert "***" in run.out
    run.assert_hides("tRustMe42")


def test_common_options_before_the_subcommand_and_url_from_the_environment(
    sqlite_url: str,
) -> None:
    assert cli("--db", sqlite_url, "init-db").code == 0
    run = cli("stats", env={"CONSUMERDEDUP_DB_URL": sqlite_url})
    assert run.code == 0, run.err
    assert "processed events" in run.out


def test_sql_prints_the_ddl_without_a_database() -> None:
    run = cli("init-db", "--sql", "--db", UNREACHABLE, "--outbox-table", "ops.outbox")
    assert run.code == 0, run.err
    assert "CREATE TABLE processed_events" in run.out
    assert "CREATE TABLE ops.outbox" in run.out
    assert 'CREATE SCHEMA IF NOT EXISTS "ops"' in run.out
    run.assert_hides("s3cr3tpw")


def test_sql_on_sqlite_creates_no_file(tmp_path: Path) -> None:
    path = tmp_path / "never.db"
    run = cli("init-db", "--sql", "--db", f"sqlite:///{path}")
    assert run.code == 0, run.err
    # processed_events, outbox, idempotency_keys, consumer_offsets, the schema version table
    assert run.out.count("CREATE TABLE") == 5
    assert "CREATE TABLE consumerdedup_schema" in run.out
    assert not path.exists()


@pytest.mark.parametrize(
    ("dialect", "extra", "url"),
    [
        ("postgresql", [], "postgresql://nobody@127.0.0.1:1/x"),
        ("postgresql", ["--partitioned"], "postgresql://nobody@127.0.0.1:1/x"),
        ("sqlite", [], "sqlite:////nonexistent-dir/never.db"),
    ],
)
def test_sql_for_a_dialect_needs_no_database(dialect: str, extra: list[str], url: str) -> None:
    """init-db --sql --dialect prints the DDL with no --db at all, and it is the DDL that
    --db of that dialect prints (a closed port, a missing directory: never contacted)."""
    bare = cli("init-db", "--sql", "--dialect", dialect, *extra)
    assert bare.code == 0, bare.err
    given = cli("init-db", "--sql", "--db", url, *extra)
    assert given.code == 0, given.err
    assert bare.out == given.out and "CREATE TABLE processed_events" in bare.out


def test_dialect_without_sql_is_a_usage_error(sqlite_url: str) -> None:
    run = cli("init-db", "--dialect", "sqlite", "--db", sqlite_url)
    assert run.code == 2 and "--dialect goes with --sql" in run.err
    assert cli("init-db", "--sql", "--dialect", "sqlite", "--partitioned").code == 2


# --- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "not a url:secretpw@",
        "postgresql://bob:secretpw@db.example:notaport/x",
        "://bob:secretpw@db.example/x",
    ],
)
@pytest.mark.parametrize("command", ["init-db", "stats"])
def test_unparseable_url_is_a_usage_error_that_hides_it(url: str, command: str) -> None:
    run = cli(command, "--db", url)
    run.assert_one_line_error(2, "secretpw")
    assert "URL" in run.err


def test_unparseable_url_with_verbose_still_hides_it() -> None:
    run = cli("init-db", "--verbose", "--db", "not a url:secretpw@")
    assert run.code == 2
    assert "Traceback" in run.err
    run.assert_hides("secretpw")


def test_unreachable_database_is_a_runtime_error() -> None:
    run = cli("init-db", "--db", UNREACHABLE)
    run.assert_one_line_error(1, "s3cr3tpw")
    assert "connect" in run.err.lower()


@pytest.mark.parametrize("url", [UNREACHABLE, "postgresql://alice@127.0.0.1:1/x?password=s3cr3tpw"])
def test_unreachable_database_with_verbose_shows_a_traceback_but_not_the_password(
    url: str,
) -> None:
    run = cli("stats", "--db", url, "--verbose")
    assert run.code == 1
    assert "Traceback" in run.err
    assert run.err_lines[-1].startswith("consumerdedup: error: ")
    run.assert_hides("s3cr3tpw")


@pytest.mark.postgres
def test_missing_database_on_a_real_server_is_a_runtime_error(postgres_url: str) -> None:
    url = make_url(postgres_url).set(password="s3cr3tpw", database=f"nodb_{uuid.uuid4().hex[:8]}")
    run = cli("init-db", "--db", url.render_as_string(hide_password=False))
    run.assert_one_line_error(1, "s3cr3tpw")
    assert "does not exist" in run.err


def test_unwritable_sqlite_path_is_a_runtime_error(tmp_path: Path) -> None:
    run = cli("init-db", "--db", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    run.assert_one_line_error(1)


def test_missing_db_is_a_usage_error() -> None:
    run = cli("init-db")
    run.assert_one_line_error(2)
    assert "--db" in run.err
    assert "CONSUMERDEDUP_DB_URL" in run.err


@pytest.mark.parametrize("name", ["bad name", "1table", "a.b.c", "x;drop"])
def test_invalid_table_name_is_a_usage_error(sqlite_url: str, name: str) -> None:
    run = cli("init-db", "--db", sqlite_url, "--outbox-table", name)
    run.assert_one_line_error(2)
    assert "expected a table name" in run.err


def test_unsupported_database_is_a_usage_error() -> None:
    run = cli("init-db", "--db", "mssql+pymssql://sa:hunter22@localhost/app")
    run.assert_one_line_error(2, "hunter22")
    assert "mssql" in run.err and "mysql+pymysql" in run.err


def test_missing_driver_is_a_usage_error() -> None:
    run = cli("init-db", "--db", "postgresql+nosuchdriver://u:hunter22@localhost/app")
    run.assert_one_line_error(2, "hunter22")


@pytest.mark.parametrize("args", [[], ["frobnicate"], ["stats", "--no-such-option"]])
def test_bad_arguments_are_usage_errors(args: list[str]) -> None:
    cli_run = cli(*args)
    cli_run.assert_one_line_error(2)


def test_stats_before_init_db_says_what_to_do(sqlite_url: str) -> None:
    run = cli("stats", "--db", sqlite_url)
    run.assert_one_line_error(1)
    assert "init-db" in run.err


def test_help() -> None:
    run = cli("--help")
    assert run.code == 0
    for command in ("init-db", "stats", "demo"):
        assert command in run.out


# --- stats -----------------------------------------------------------------------------------


def seed(url: str, tables: Tables) -> None:
    """Three records for 'orders' (one failed), one for 'billing', and a failing outbox row."""
    now = datetime.now(UTC)
    pe, ob = tables.processed_events, tables.outbox
    records = [
        ("orders", "m1", now - timedelta(hours=3), "processed", None),
        ("orders", "m2", now - timedelta(hours=2), "failed", "PermanentError: no"),
        ("orders", "m3", now - timedelta(hours=1), "processed", None),
        ("billing", "b1", now, "processed", None),
    ]
    keys = ("consumer", "message_id", "processed_at", "outcome", "error")
    outbox = [
        {"event_id": f"e{i}", "attempts": attempts, "published_at": published}
        for i, (attempts, published) in enumerate([(0, now), (0, None), (3, None)])
    ]
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            insert(pe), [dict(zip(keys, r, strict=True), payload_hash="h" * 64) for r in records]
        )
        common = {"destination": "d", "body": b"{}", "headers": {}}
        old = now - timedelta(hours=5)
        conn.execute(
            insert(ob),
            [{**row, **common, "created_at": old, "available_at": old} for row in outbox],
        )
    engine.dispose()


def check_stats(options: list[str], tables: Tables) -> None:
    text_run = cli("stats", *options)
    assert text_run.code == 0, text_run.err
    lines = {line.split()[0]: line.split() for line in text_run.out.splitlines() if line.strip()}
    assert lines["orders"][1:3] == ["2", "1"]
    assert lines["billing"][1:3] == ["1", "0"]

    json_run = cli("stats", "--json", *options)
    assert json_run.code == 0, json_run.err
    report = json.loads(json_run.out)
    consumers = {c["consumer"]: c for c in report["processed_events"]["consumers"]}
    assert set(consumers) == {"orders", "billing"}
    assert (consumers["orders"]["processed"], consumers["orders"]["failed"]) == (2, 1)
    oldest = datetime.fromisoformat(consumers["orders"]["oldest"])
    newest = datetime.fromisoformat(consumers["orders"]["newest"])
    assert timedelta(hours=1.9) < newest - oldest < timedelta(hours=2.1)
    outbox = report["outbox"]
    assert outbox["table"] == tables.outbox.fullname
    assert (outbox["unpublished"], outbox["published"], outbox["failing"]) == (2, 1, 1)
    assert 4.9 * 3600 < outbox["oldest_unpublished_age_seconds"] < 5.5 * 3600
    assert "5h" in text_run.out


def test_stats_on_sqlite(sqlite_url: str) -> None:
    assert cli("init-db", "--db", sqlite_url).code == 0
    seed(sqlite_url, Tables.define())
    check_stats(["--db", sqlite_url], Tables.define())


@pytest.mark.postgres
def test_stats_on_postgres(pg_target: PgTarget) -> None:
    assert cli("init-db", *pg_target.options).code == 0
    tables = Tables.define(f"{pg_target.schema}.processed_events", f"{pg_target.schema}.outbox")
    seed(pg_target.url, tables)
    check_stats(pg_target.options, tables)


def test_stats_on_mariadb(my_target: PgTarget) -> None:
    assert cli("init-db", *my_target.options).code == 0
    tables = Tables.define(f"{my_target.schema}.processed_events", f"{my_target.schema}.outbox")
    seed(my_target.url, tables)
    check_stats(my_target.options, tables)


def test_stats_of_empty_tables(sqlite_url: str) -> None:
    assert cli("init-db", "--db", sqlite_url).code == 0
    run = cli("stats", "--db", sqlite_url, "--json")
    assert run.code == 0, run.err
    report = json.loads(run.out)
    assert report["processed_events"]["consumers"] == []
    assert report["outbox"]["oldest_unpublished_age_seconds"] is None


# --- demo ------------------------------------------------------------------------------------


def test_demo_needs_no_database() -> None:
    run = cli("demo")
    assert run.code == 0, run.err
    assert "balances are exact" in run.out
