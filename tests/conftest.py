from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from consumerdedup import Tables, install
from tests.support import mariadb_service, services

# CI (CI=true, as .ci/run sets): the same examples on every run, so a failure found there
# is found again; no per-example deadline on a loaded 2-core machine (a slow example is
# not a wrong one); no example database written. Modules that set max_examples keep theirs.
settings.register_profile(
    "consumerdedup-ci",
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
    settings.load_profile("consumerdedup-ci")


@dataclass
class Database:
    """One isolated database for a test: its own schema on PostgreSQL, its own file on SQLite."""

    dialect: str
    url: str
    async_url: str
    schema: str | None
    engine: Engine
    tables: Tables

    def name(self, table: str) -> str:
        """A table name qualified with this test's schema, for raw SQL."""
        return f"{self.schema}.{table}" if self.schema else table

    def async_engine(self) -> AsyncEngine:
        return create_async_engine(self.async_url, **_engine_options(self.dialect))

    def scalar(self, sql: str) -> object:
        with self.engine.connect() as conn:
            return conn.execute(text(sql)).scalar()

    def create_ledger(self) -> str:
        """The business table of most tests: no unique key, so only dedup prevents doubles."""
        name = self.name("ledger")
        with self.engine.begin() as conn:
            conn.execute(
                text(f"CREATE TABLE {name} (account VARCHAR(64), amount INTEGER, message_id TEXT)")
            )
        return name


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """An asyncpg flavor runs on PostgreSQL only: its pairings with another database are
    not tests at all (deselected, not skipped: CI counts a skip as a failure)."""
    kept, dropped = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        on_asyncpg = str(params.get("flavor", "")).startswith("asyncpg-")
        elsewhere = not str(params.get("db", "postgresql")).startswith("postgresql")
        (dropped if on_asyncpg and elsewhere else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """In CI (``services.required()``) a skipped test is a failed one, whatever skipped it:
    ``pytest.skip``, a skip marker, ``importorskip``. An expected failure (xfail) stays one."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and not hasattr(report, "wasxfail") and services.required():
        report.outcome = "failed"
        report.longrepr = f"skipped in CI ({services.REQUIRED_NOTE}): {_skip_reason(report)}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """The same for a whole module skipped at import (``pytest.skip(allow_module_level=True)``
    or a module-level ``importorskip``)."""
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()  # type: ignore[attr-defined]
    if report.skipped and services.required():
        report.outcome = "failed"
        report.longrepr = f"skipped in CI ({services.REQUIRED_NOTE}): {_skip_reason(report)}"


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2])
    return str(longrepr)


def _engine_options(dialect: str) -> dict[str, object]:
    if dialect == "sqlite":
        return {"connect_args": {"timeout": 30}}
    return {"pool_size": 20, "max_overflow": 10}


@pytest.fixture(scope="session")
def postgres_url() -> str:
    return services.postgres_url()


@pytest.fixture(scope="session")
def mariadb_url() -> str:
    return mariadb_service.mariadb_url()


def _sqlite(tmp_path: Path) -> Iterator[Database]:
    path = tmp_path / "test.db"
    engine = create_engine(f"sqlite:///{path}", **_engine_options("sqlite"))
    with engine.connect() as conn:
        conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    tables = Tables.define()
    install(engine, tables)
    yield Database(
        "sqlite", f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}", None, engine, tables
    )
    engine.dispose()


def _postgres(url: str, partitioned: bool = False) -> Iterator[Database]:
    schema = f"t_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url, **_engine_options("postgresql"))
    tables = Tables.define(
        f"{schema}.processed_events", f"{schema}.outbox", partitioned=partitioned
    )
    install(engine, tables)
    async_url = make_url(url).set(drivername="postgresql+psycopg").render_as_string(False)
    try:
        yield Database("postgresql", url, async_url, schema, engine, tables)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()


def _mariadb(url: str) -> Iterator[Database]:
    """A database of the test's own on the MariaDB server (a MySQL schema is a database)."""
    with mariadb_service.isolated_database(url) as schema:
        engine = create_engine(mariadb_service.in_database(url, schema), **_engine_options("mysql"))
        tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
        try:
            install(engine, tables)
            yield Database(
                "mysql",
                mariadb_service.in_database(url, schema),
                mariadb_service.async_url(mariadb_service.in_database(url, schema)),
                schema,
                engine,
                tables,
            )
        finally:
            engine.dispose()


def postgres_database(url: str, partitioned: bool = False) -> Iterator[Database]:
    """A schema of its own on the PostgreSQL server at ``url`` (a private one, say)."""
    yield from _postgres(url, partitioned=partitioned)


def database(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> Iterator[Database]:
    """``sqlite``, ``postgresql``, ``postgresql-partitioned`` (processed_events by day), or
    ``mariadb`` (MariaDB/MySQL through PyMySQL, aiomysql for asyncio)."""
    if kind == "sqlite":
        yield from _sqlite(tmp_path)
    elif kind == "mariadb":
        yield from _mariadb(request.getfixturevalue("mariadb_url"))
    else:
        url = request.getfixturevalue("postgres_url")
        yield from _postgres(url, partitioned=kind == "postgresql-partitioned")


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """Each test using it runs on SQLite and on the real PostgreSQL.

    Modules about the claim itself override it to add a partitioned processed_events.
    """
    yield from database(request, request.param, tmp_path)


@pytest.fixture
def pg_engine(postgres_url: str) -> Iterator[Engine]:
    """An engine on the test PostgreSQL, for tests that make their own tables."""
    engine = create_engine(postgres_url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_schema(postgres_url: str) -> Iterator[str]:
    """A schema name nobody uses; dropped afterwards whether or not the test created it."""
    name = f"s_{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        engine = create_engine(postgres_url)
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        engine.dispose()


@pytest.fixture
def pg_partitioned(postgres_url: str) -> Iterator[Database]:
    """PostgreSQL with processed_events range-partitioned by day."""
    yield from _postgres(postgres_url, partitioned=True)


@pytest.fixture
def pg(postgres_url: str) -> Iterator[Database]:
    """PostgreSQL only: for tests of what SQLite cannot do (true concurrent writers)."""
    yield from _postgres(postgres_url)


@pytest.fixture
def mariadb(mariadb_url: str) -> Iterator[Database]:
    """MariaDB only (InnoDB): a database of the test's own, the library's tables installed."""
    yield from _mariadb(mariadb_url)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[Database]:
    yield from _sqlite(tmp_path)


FLAVORS = ["sync-claim", "sync-check", "async-claim", "async-check"]
ASYNCPG_FLAVORS = ["asyncpg-claim", "asyncpg-check"]
"""AsyncDeduplicator on asyncpg: PostgreSQL only (pytest_collection_modifyitems)."""


@pytest.fixture(params=FLAVORS + ASYNCPG_FLAVORS)
def flavor(request: pytest.FixtureRequest, db: Database) -> Iterator[object]:
    """Deduplicator or AsyncDeduplicator (psycopg or aiosqlite; on PostgreSQL asyncpg too),
    claim-first or check-first, on ``db``'s database."""
    from tests.support.flavors import AsyncFlavor, AsyncpgFlavor, SyncFlavor

    kind, mode = request.param.split("-")
    flavor_class = {"sync": SyncFlavor, "async": AsyncFlavor, "asyncpg": AsyncpgFlavor}[kind]
    chosen = flavor_class(db, claim_first=mode == "claim")
    yield chosen
    chosen.close()
