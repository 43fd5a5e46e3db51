"""The guard fails closed (issue 17, items 1 to 5): what it cannot verify it refuses.

Autocommit engines and connections, transaction control in any spelling, a
session factory on another engine, drivers whose transaction state we cannot
read, and handlers whose call does not run their body: each is refused with
ConfigurationError or failed alone, and never reported PROCESSED without its
effect committed with its record.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, create_mock_engine, text
from sqlalchemy.engine import URL
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import AsyncDeduplicator, ConfigurationError, Deduplicator, Message, Outcome
from consumerdedup.db.dialects import SUPPORTED_DRIVERS
from consumerdedup.errors import CommitInHandler, TransactionBroken
from tests.conftest import Database
from tests.core.test_pipeline_attacks import FAST, assert_invariants, create_ledger, effects, order
from tests.support.flavors import SWALLOW, AsyncFlavor, SyncFlavor

# The supported and refused drivers are listed on the consumers page (README: newcomer page).
README = Path(__file__).resolve().parents[2] / "docs" / "consumers.md"
KINDS = [("sync", True), ("sync", False), ("async", True), ("async", False)]
KIND_IDS = ["sync-claim", "sync-check", "async-claim", "async-check"]


def records(db: Database) -> list[str]:
    with db.engine.connect() as conn:
        return [r.message_id for r in conn.execute(db.tables.processed_events.select())]


def insert(ledger: str) -> tuple[str, dict[str, Any]]:
    return f"INSERT INTO {ledger} (message_id) VALUES (:m)", {}


def run(kind: str, db: Database, factory: Callable[[], Any], claim_first: bool, fn: Any) -> Any:
    """Process one message ``m1`` with ``fn`` as the handler on a session from ``factory``."""
    if kind == "sync":
        dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST, session_factory=factory)
        return dedup.handler(claim_first=claim_first)(fn).process(order("m1"))
    engine = db.async_engine()

    async def go() -> Any:
        try:
            dedup = AsyncDeduplicator(
                engine, "c", tables=db.tables, retry=FAST, session_factory=factory
            )
            return await dedup.handler(claim_first=claim_first)(fn).process(order("m1"))
        finally:
            await engine.dispose()

    return asyncio.run(go())


# 1. Autocommit ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["create_engine", "execution_options", "sessionmaker"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_autocommit_engine_is_refused_at_construction(pg: Database, how: str, kind: str) -> None:
    make = create_engine if kind == "sync" else create_async_engine
    url = pg.url if kind == "sync" else pg.async_url
    plain = make(url)
    autocommit = make(url, isolation_level="AUTOCOMMIT")
    if how == "execution_options":
        autocommit = plain.execution_options(isolation_level="AUTOCOMMIT")
    engine, options = autocommit, {}
    if how == "sessionmaker":  # the deduplicator's engine is fine, the sessions' is not
        maker = sessionmaker if kind == "sync" else async_sessionmaker
        engine, options = plain, {"session_factory": maker(autocommit)}
    deduplicator: Any = Deduplicator if kind == "sync" else AsyncDeduplicator
    with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
        deduplicator(engine, "c", tables=pg.tables, **options)


@pytest.mark.parametrize("how", ["driver connect_args", "factory over an autocommit engine"])
@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_an_autocommit_connection_is_refused_before_any_statement(
    pg: Database, how: str, kind: str, claim_first: bool
) -> None:
    """What construction cannot see is refused on the connection itself: nothing is claimed."""
    ledger = create_ledger(pg)
    url = pg.url if kind == "sync" else pg.async_url
    make: Any = create_engine if kind == "sync" else create_async_engine
    if how == "driver connect_args":
        other = make(url, connect_args={"autocommit": True})
    else:
        other = make(url, isolation_level="AUTOCOMMIT")
    session_class: Any = Session if kind == "sync" else AsyncSession
    called = []

    def sync_handler(message: Message, session: Any) -> None:
        called.append(message.id)
        session.execute(text(insert(ledger)[0]), {"m": message.id})

    async def async_handler(message: Message, session: Any) -> None:
        called.append(message.id)
        await session.execute(text(insert(ledger)[0]), {"m": message.id})

    handler = sync_handler if kind == "sync" else async_handler
    try:
        with pytest.raises(ConfigurationError, match="AUTOCOMMIT"):
            run(kind, pg, lambda: session_class(other), claim_first, handler)
    finally:
        if kind == "sync":
            other.dispose()
        else:
            asyncio.run(other.dispose())
    assert (called, effects(pg, ledger), records(pg)) == ([], [], [])


@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_sqlite_in_autocommit_mode_still_gets_one_real_transaction(
    sqlite_db: Database, kind: str, claim_first: bool
) -> None:
    """BEGIN IMMEDIATE makes it real: a handler that writes and then fails leaves no effect."""
    db = sqlite_db
    ledger = create_ledger(db)
    url = db.url if kind == "sync" else db.async_url
    make: Any = create_engine if kind == "sync" else create_async_engine
    other = make(url, isolation_level="AUTOCOMMIT")
    maker: Any = sessionmaker if kind == "sync" else async_sessionmaker
    flavor: Any = (SyncFlavor if kind == "sync" else AsyncFlavor)(db, claim_first)
    with db.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE strict (k TEXT UNIQUE)")
        conn.exec_driver_sql("INSERT INTO strict VALUES ('k')")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(insert(ledger)[0], {"m": message.id})]
        if message.json().get("bad"):
            steps.append(("INSERT INTO strict VALUES ('k')", {}))  # IntegrityError: permanent
        return steps

    try:
        handle = flavor.wrap(behavior, consumer="c", retry=FAST, session_factory=maker(other))
        results = handle.process_batch([order("a1"), order("a2", bad=True), order("a3")])
    finally:
        flavor.close()
        other.dispose() if kind == "sync" else asyncio.run(other.dispose())
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert effects(db, ledger) == ["a1", "a3"]
    assert_invariants(db, ledger, results)


# 2. Transaction control in any spelling ------------------------------------------------------

EVERYWHERE = ["/* end */ COMMIT", "-- end\nCOMMIT", " \n\tCoMmIt", "/* a */ /* b */ END"]
POSTGRES_ONLY = [
    "SELECT 1; COMMIT",
    "/* outer /* nested */ still comment */ COMMIT",
    "commit work",
    "COMMIT AND CHAIN",
    ";;COMMIT",
    "ABORT",
    "ROLLBACK AND CHAIN",
    "SELECT 'a\\'' ; COMMIT --'",  # PostgreSQL's reading: a string, then COMMIT
    'SELECT 1 AS "x;"; COMMIT',
    "SELECT $q$ ; $q$; COMMIT",
    "SELECT 1 AS a$b$ ; COMMIT --$b$",  # a$b$ is one name: no dollar quote starts there
]


def ends_alone(db: Database, flavor: Any, spelling: str) -> None:
    """Batch [a, bad, c]: bad's COMMIT would commit all three claims and a's effect, and the
    next attempts would answer c DUPLICATE without ever running it."""
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(insert(ledger)[0], {"m": message.id})]
        if message.json().get("end"):
            steps += [(spelling, {}), steps[0]]
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST)
    batch = [order("t1"), order("t2", end=True), order("t3")]
    results = handle.process_batch(batch)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, CommitInHandler | TransactionBroken), results[1].reason
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)
    again = handle.process_batch(batch)
    assert [r.outcome for r in again] == [Outcome.DUPLICATE, Outcome.FAILED, Outcome.DUPLICATE]


@pytest.mark.parametrize("spelling", EVERYWHERE)
def test_transaction_control_in_any_spelling_fails_its_message_alone(
    db: Database, flavor: Any, spelling: str
) -> None:
    ends_alone(db, flavor, spelling)


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
@pytest.mark.parametrize("spelling", POSTGRES_ONLY)
def test_postgresql_spellings_of_transaction_control_fail_their_message_alone(
    db: Database, flavor: Any, spelling: str
) -> None:
    ends_alone(db, flavor, spelling)


@pytest.mark.parametrize(
    "statement",
    [
        'SELECT 1 AS "commit"',
        "SELECT 'x; COMMIT'",
        "SELECT 1 -- ; COMMIT",
        "SELECT 1 /* ; END */",
        "SELECT CASE WHEN 1 = 1 THEN 'begin' END",
    ],
)
def test_text_that_only_mentions_control_words_runs(
    db: Database, flavor: Any, statement: str
) -> None:
    ledger = create_ledger(db)
    handle = flavor.wrap(
        lambda m: [(statement, {}), (insert(ledger)[0], {"m": m.id})], consumer="c", retry=FAST
    )
    result = handle.process(order("m1"))
    assert result.outcome is Outcome.PROCESSED, result.reason
    assert effects(db, ledger) == ["m1"]


def test_a_statement_that_ends_the_transaction_is_stopped_at_that_statement(
    db: Database, flavor: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the text check ever miss a spelling, the driver's transaction state read after
    the statement stops the handler there: nothing after it runs outside the transaction."""
    from consumerdedup.dedup import handler_guard

    monkeypatch.setattr(handler_guard, "transaction_control", lambda sql, dialect: None)
    ledger = create_ledger(db)
    after = db.name("after_commit")
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {after} (message_id TEXT)")
    handle = flavor.wrap(
        lambda m: [
            (insert(ledger)[0], {"m": m.id}),
            ("COMMIT", {}),
            (f"INSERT INTO {after} VALUES (:m)", {"m": m.id}),
        ],
        consumer="c",
        retry=FAST,
    )
    result = handle.process(order("m1"))
    assert result.outcome is not Outcome.PROCESSED
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT count(*) FROM {after}").scalar() == 0


# 3. A session factory on another engine -------------------------------------------------------


@pytest.fixture(params=["sessionmaker", "plain callable"])
def other_factory(request: pytest.FixtureRequest, db: Database, flavor: Any) -> Iterator[Any]:
    """Sessions on a second engine of the same database (the application's own pool)."""
    if flavor.name == "sync":
        engine: Any = create_engine(db.url)
        maker: Any = sessionmaker(engine) if request.param == "sessionmaker" else None
        yield maker or (lambda: Session(engine))
        engine.dispose()
    else:
        engine = db.async_engine()
        maker = async_sessionmaker(engine) if request.param == "sessionmaker" else None
        yield maker or (lambda: AsyncSession(engine))
        flavor.loop.run_until_complete(engine.dispose())


@pytest.mark.parametrize("control", ["COMMIT", "ROLLBACK", "/* x */ COMMIT"])
def test_a_session_factory_on_another_engine_is_guarded(
    db: Database, flavor: Any, other_factory: Any, control: str
) -> None:
    ledger = create_ledger(db)

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(insert(ledger)[0], {"m": message.id})]
        if message.json().get("end"):
            steps += [(control, {}), steps[0]]
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST, session_factory=other_factory)
    results = handle.process_batch([order("t1"), order("t2", end=True), order("t3")])
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert effects(db, ledger) == ["t1", "t3"]
    assert_invariants(db, ledger, results)


def test_a_connection_commit_on_another_engine_is_refused(db: Database) -> None:
    ledger = create_ledger(db)
    other = create_engine(db.url)
    dedup = Deduplicator(
        db.engine, "c", tables=db.tables, retry=FAST, session_factory=lambda: Session(other)
    )

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(insert(ledger)[0]), {"m": message.id})
        if message.json().get("commit"):
            session.connection().commit()

    try:
        results = handle.process_batch([order("c1"), order("c2", commit=True), order("c3")])
    finally:
        other.dispose()
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, CommitInHandler)
    assert effects(db, ledger) == ["c1", "c3"]


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_sqlite_rollback_on_conflict_on_another_engine_leaves_nothing(
    db: Database, flavor: Any, other_factory: Any
) -> None:
    """INSERT OR ROLLBACK ends SQLite's transaction (the claim with it); a handler that swallows
    that error and writes on would commit its write alone, with no dedup record."""
    ledger = create_ledger(db)
    with db.engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE strict (k TEXT UNIQUE)")
        conn.exec_driver_sql("INSERT INTO strict VALUES ('k')")

    def behavior(message: Message) -> list[tuple[str, dict[str, Any]]]:
        steps = [(insert(ledger)[0], {"m": message.id})]
        if message.json().get("conflict"):
            steps = [(f"{SWALLOW}INSERT OR ROLLBACK INTO strict VALUES ('k')", {}), *steps]
        return steps

    handle = flavor.wrap(behavior, consumer="c", retry=FAST, session_factory=other_factory)
    batch = [order("r1"), order("r2", conflict=True), order("r3")]
    results = handle.process_batch(batch)
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    handle.process_batch(batch)  # the redelivery applies nothing a second time
    assert effects(db, ledger) == ["r1", "r3"]
    assert_invariants(db, ledger, results)


# 4. Drivers -----------------------------------------------------------------------------------

SHIPPED = {
    "postgresql": ["psycopg", "psycopg_async", "psycopg2", "psycopg2cffi", "pg8000", "asyncpg"],
    "sqlite": ["pysqlite", "aiosqlite", "pysqlcipher"],
}
"""Every postgresql+* and sqlite+* driver SQLAlchemy ships (sqlalchemy.dialects registry)."""
TESTED = {"psycopg", "psycopg_async", "pysqlite", "aiosqlite", "asyncpg"}
"""Driven by every pipeline test through the fixtures (postgresql+psycopg, sqlite, aiosqlite,
and postgresql+asyncpg: the asyncpg flavors)."""


@pytest.mark.parametrize(
    ("dialect", "driver"), [(d, v) for d, vs in SHIPPED.items() for v in vs], ids=str
)
def test_every_shipped_driver_is_supported_with_tests_or_refused(dialect: str, driver: str) -> None:
    dialect_class = URL.create(f"{dialect}+{driver}").get_dialect()
    name = dialect_class.driver
    if driver in TESTED:
        assert name in SUPPORTED_DRIVERS[dialect]
        assert f"{dialect}+{name}" in README.read_text()
        return
    assert name not in SUPPORTED_DRIVERS[dialect]
    # An Engine (Deduplicator refuses anything else) with that driver's dialect: the driver
    # itself need not be installed for the refusal.
    engine: Any = create_engine("sqlite://")
    engine.dialect = create_mock_engine(URL.create(f"{dialect}+{driver}"), print).dialect
    with pytest.raises(ConfigurationError, match=rf"{dialect}\+{name} is not supported"):
        Deduplicator(engine, "c")
    assert f"{dialect}+{name}" in README.read_text(), "docs/consumers.md lists refused drivers too"


def test_the_list_of_shipped_drivers_is_complete() -> None:
    import importlib
    import pkgutil

    import sqlalchemy.dialects.postgresql as postgresql
    import sqlalchemy.dialects.sqlite as sqlite

    for package in (postgresql, sqlite):
        for module_info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{module_info.name}")
            for attribute in ("dialect", "dialect_async"):
                found = getattr(module, attribute, None)
                if isinstance(found, type) and module_info.name not in ("base", "provision"):
                    listed = {
                        URL.create(f"{found.name}+{d}").get_dialect().driver
                        for d in SHIPPED[found.name]
                    }
                    assert found.driver in listed, (module.__name__, found.driver)


def test_an_asyncpg_engine_over_another_module_is_refused_before_any_statement(
    pg: Database,
) -> None:
    """asyncpg raises nothing at a COMMIT PostgreSQL answered with ROLLBACK: it is supported
    because the guard verifies with the server (tests/attacks/test_asyncpg_verification.py).
    A connection that is not asyncpg's own cannot be verified: refused, nothing claimed."""
    import asyncpg
    from sqlalchemy.engine import make_url

    class Wrapped:  # a tracing proxy around asyncpg's connection
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    async def creator() -> Any:
        return Wrapped(await asyncpg.connect(plain))

    async def nothing(message: Message, session: Any) -> None:
        pass

    plain = make_url(pg.url).set(drivername="postgresql").render_as_string(False)
    engine = create_async_engine("postgresql+asyncpg://", async_creator=creator)

    async def go() -> None:
        try:
            dedup = AsyncDeduplicator(engine, "c", tables=pg.tables, retry=FAST)
            handle = dedup.handler(nothing)
            with pytest.raises(ConfigurationError, match="does not report"):
                await handle.process(order("m1"))
        finally:
            await engine.dispose()

    asyncio.run(go())
    assert records(pg) == []


# 5. Handlers whose call does not run their body -----------------------------------------------


def generator_handler(message: Message, session: Any) -> Iterator[None]:
    session.execute(text("SELECT 1"))
    yield


async def async_generator_handler(message: Message, session: Any) -> AsyncIterator[None]:
    yield


async def coroutine_handler(message: Message, session: Any) -> None:
    pass


class GeneratorCallable:
    def __call__(self, message: Message, session: Any) -> Iterator[None]:
        yield


class AsyncGeneratorCallable:
    async def __call__(self, message: Message, session: Any) -> AsyncIterator[None]:
        yield


class CoroutineCallable:
    async def __call__(self, message: Message, session: Any) -> None:
        pass


NOT_BLOCKING = {
    "generator": generator_handler,
    "async generator": async_generator_handler,
    "coroutine": coroutine_handler,
    "partial of a generator": functools.partial(generator_handler),
    "partial of a coroutine": functools.partial(coroutine_handler),
    "callable object, generator": GeneratorCallable(),
    "callable object, coroutine": CoroutineCallable(),
}
NOT_ASYNC = {
    "generator": generator_handler,
    "async generator": async_generator_handler,
    "partial of an async generator": functools.partial(async_generator_handler),
    "callable object, async generator": AsyncGeneratorCallable(),
    "callable object, generator": GeneratorCallable(),
}


@pytest.mark.parametrize("name", list(NOT_BLOCKING))
def test_a_blocking_handler_whose_call_does_not_run_is_refused(
    sqlite_db: Database, name: str
) -> None:
    dedup = Deduplicator(sqlite_db.engine, "c", tables=sqlite_db.tables)
    with pytest.raises(ConfigurationError, match=r"(does not run its body|AsyncDeduplicator)"):
        dedup.handler(NOT_BLOCKING[name])


@pytest.mark.parametrize("name", list(NOT_ASYNC))
def test_an_async_handler_whose_call_does_not_run_is_refused(
    sqlite_db: Database, name: str
) -> None:
    dedup = AsyncDeduplicator(create_async_engine(sqlite_db.async_url), "c")
    with pytest.raises(ConfigurationError, match="does not run its body"):
        dedup.handler(NOT_ASYNC[name])


def test_an_async_callable_object_is_a_handler(sqlite_db: Database) -> None:
    db = sqlite_db
    ledger = create_ledger(db)

    class Handler:
        async def __call__(self, message: Message, session: AsyncSession) -> None:
            await session.execute(text(insert(ledger)[0]), {"m": message.id})

    engine = db.async_engine()

    async def go() -> Outcome:
        try:
            dedup = AsyncDeduplicator(engine, "c", tables=db.tables)
            return await dedup.handler(Handler())(order("m1"))
        finally:
            await engine.dispose()

    assert asyncio.run(go()) is Outcome.PROCESSED
    assert effects(db, ledger) == ["m1"]


def _gen(ledger: str) -> Callable[[Message, Any], Any]:
    def body(message: Message, session: Any) -> Iterator[None]:
        session.execute(text(insert(ledger)[0]), {"m": message.id})
        yield

    return body


@pytest.mark.parametrize("returns", ["generator", "coroutine", "async generator"])
@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_a_handler_that_returns_its_work_unrun_records_nothing(
    db: Database, kind: str, claim_first: bool, returns: str
) -> None:
    """A plain function (or an async def) that hands back a generator or an un-awaited
    coroutine: its body never ran. A setup fault: ConfigurationError, nothing recorded."""
    ledger = create_ledger(db)

    async def later(message: Message, session: Any) -> None:
        await session.execute(text(insert(ledger)[0]), {"m": message.id})

    async def agen(message: Message, session: Any) -> AsyncIterator[None]:
        yield

    inner: Any = {"generator": _gen(ledger), "async generator": agen}.get(returns, later)
    if kind == "sync":

        def handler(message: Message, session: Any) -> Any:
            return inner(message, session)
    else:

        async def handler(message: Message, session: Any) -> Any:  # type: ignore[misc]
            return inner(message, session)

    with pytest.raises(ConfigurationError, match="body did not run"):
        run(kind, db, None, claim_first, handler)  # type: ignore[arg-type]
    assert (effects(db, ledger), records(db)) == ([], [])


@pytest.mark.parametrize(("kind", "claim_first"), KINDS, ids=KIND_IDS)
def test_a_session_that_would_join_the_callers_transaction_is_refused(
    db: Database, kind: str, claim_first: bool
) -> None:
    """A session bound to a Connection already in a transaction joins it: its commit commits
    nothing, so PROCESSED would be reported (and acked) for work the caller may roll back."""
    ledger = create_ledger(db)
    statement = text(insert(ledger)[0])
    if kind == "sync":
        conn = db.engine.connect()
        conn.begin()

        def handler(message: Message, session: Any) -> None:
            session.execute(statement, {"m": message.id})

        try:
            with pytest.raises(ConfigurationError, match="already in a transaction"):
                run(kind, db, lambda: Session(bind=conn), claim_first, handler)
        finally:
            conn.rollback()  # the caller changes its mind
            conn.close()
    else:
        engine = db.async_engine()

        async def async_handler(message: Message, session: Any) -> None:
            await session.execute(statement, {"m": message.id})

        async def go() -> None:
            async with engine.connect() as conn:
                await conn.begin()
                dedup = AsyncDeduplicator(
                    engine, "c", tables=db.tables, session_factory=lambda: AsyncSession(bind=conn)
                )
                handle = dedup.handler(claim_first=claim_first)(async_handler)
                try:
                    with pytest.raises(ConfigurationError, match="already in a transaction"):
                        await handle.process(order("m1"))
                finally:
                    await conn.rollback()
            await engine.dispose()

        asyncio.run(go())
    assert (effects(db, ledger), records(db)) == ([], [])
