"""The guard touches only what a handler is handed, and only while it runs (issue 19, item 4).

Importing consumerdedup and making deduplicators adds no SQLAlchemy listener anywhere: not
on the Session class, nor on the engine, its dialect or its pool. While a handler runs, the
listeners sit on that call's session and on the connection it uses, and come off when the
call ends, so every other session and connection (in the same thread or another) commits
as it would without us; and a session made from another engine than the deduplicator's is
guarded all the same, as it is the session the handler really uses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from consumerdedup import Deduplicator, Message, Outcome
from consumerdedup.errors import CommitInHandler
from tests.conftest import Database
from tests.core.test_pipeline_attacks import FAST, create_ledger, effects, order

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import asyncio, importlib, json, pkgutil, sys
from sqlalchemy import create_engine
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import Session

path = sys.argv[1]
engine = create_engine(f"sqlite:///{path}")
async_engine = create_async_engine(f"sqlite+aiosqlite:///{path}")

def listeners():
    session = Session(create_engine("sqlite://"))  # on another engine: the class's own
    found = {}
    for where, dispatch in [
        ("Session", session.dispatch),
        ("engine", engine.dispatch),
        ("dialect", engine.dialect.dispatch),
        ("pool", engine.pool.dispatch),
        ("async engine", async_engine.sync_engine.dispatch),
        ("async dialect", async_engine.sync_engine.dialect.dispatch),
    ]:
        for name in dispatch._event_names:
            if len(getattr(dispatch, name)):
                found[f"{where}.{name}"] = len(getattr(dispatch, name))
    return found

before = listeners()
import consumerdedup
for module in pkgutil.walk_packages(consumerdedup.__path__, "consumerdedup."):
    try:
        importlib.import_module(module.name)
    except ImportError:  # an extra that is not installed
        pass
from consumerdedup import AsyncDeduplicator, Deduplicator, Tables, install

install(engine, Tables.define())
Deduplicator(engine, "c")
AsyncDeduplicator(async_engine, "c")
print(json.dumps({"before": before, "after": listeners()}))
asyncio.run(async_engine.dispose())
"""


def test_importing_and_constructing_installs_no_listener(tmp_path: Path) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "probe.db")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(probe.stdout)
    # (SQLAlchemy's own: the SQLite dialect's on-connect hooks on the pool.)
    assert seen["after"] == seen["before"], seen


def listeners_on(target: Session | Connection | Engine) -> int:
    """How many listeners ``target`` has for any of its events (its engine's included)."""
    dispatch: Any = target.dispatch
    owner: Any = target if isinstance(target, Session) else target.engine
    names: list[str] = owner.dispatch._event_names
    return sum(len(getattr(dispatch, name)) for name in names)


def connection_watched(connection: Connection) -> bool:
    """The handler's statements on ``connection`` are watched: through SQLAlchemy's events
    (SQLite), or at the psycopg connection's cursors (its ``cursor()`` made watching on the
    instance while the attempt's handlers run, taken off after)."""
    raw: Any = connection.connection.driver_connection
    return listeners_on(connection) > 0 or "cursor" in vars(raw)


def assert_engine_untouched(engine: Engine) -> None:
    assert listeners_on(engine) == 0
    assert len(engine.dialect.dispatch.handle_error) == 0


def test_other_sessions_in_the_same_thread_commit_freely(db: Database) -> None:
    """And the session handed to handlers, when the caller uses it between calls."""
    ledger = create_ledger(db)
    shared = Session(db.engine)  # a factory giving one long-lived session
    dedup = Deduplicator(
        db.engine, "c", tables=db.tables, retry=FAST, session_factory=lambda: shared
    )
    during: list[tuple[int, bool]] = []

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        during.append((listeners_on(session), connection_watched(session.connection())))
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})

    assert_engine_untouched(db.engine)
    assert handle(order("m1")) is Outcome.PROCESSED
    assert during[0][0] > 0 and during[0][1]  # the guard was there
    assert_engine_untouched(db.engine)
    raw: Any = shared.connection().connection.driver_connection
    assert not {"cursor", "commit"} & set(getattr(raw, "__dict__", {})), "nothing of the guard"
    shared.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('shared')"))
    shared.commit()
    shared.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('shared-conn')"))
    shared.connection().commit()
    shared.close()
    assert handle(order("m2")) is Outcome.PROCESSED
    with Session(db.engine) as plain:
        plain.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('plain')"))
        assert listeners_on(plain) == listeners_on(plain.connection()) == 0
        plain.commit()
    with db.engine.connect() as conn:
        conn.exec_driver_sql(f"INSERT INTO {ledger} (message_id) VALUES ('sql')")
        conn.exec_driver_sql("COMMIT")
    assert effects(db, ledger) == ["m1", "shared", "shared-conn", "m2", "plain", "sql"]


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_other_sessions_commit_freely_while_a_handler_runs_in_another_thread(
    db: Database,
) -> None:
    """PostgreSQL: SQLite would make the main thread's writes wait for the handler's lock."""
    ledger = create_ledger(db)
    dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)
    inside, release = threading.Event(), threading.Event()
    outcome: list[Outcome] = []

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        inside.set()
        assert release.wait(60)

    worker = threading.Thread(target=lambda: outcome.append(handle(order("m1"))))
    worker.start()
    try:
        assert inside.wait(60)
        assert_engine_untouched(db.engine)
        with Session(db.engine) as plain:
            plain.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('plain')"))
            assert listeners_on(plain) == listeners_on(plain.connection()) == 0
            plain.commit()
        with db.engine.connect() as conn:
            conn.exec_driver_sql(f"INSERT INTO {ledger} (message_id) VALUES ('sql')")
            conn.exec_driver_sql("COMMIT")
        raw = db.engine.raw_connection()
        try:
            raw.cursor().execute(f"INSERT INTO {ledger} (message_id) VALUES ('raw')")
            raw.commit()
        finally:
            raw.close()
    finally:
        release.set()
        worker.join(60)
    assert outcome == [Outcome.PROCESSED]
    assert sorted(effects(db, ledger)) == ["m1", "plain", "raw", "sql"]


@pytest.mark.parametrize("how", ["session.commit()", "COMMIT", "connection.commit()"])
def test_a_commit_on_a_session_of_an_engine_made_later_is_refused(db: Database, how: str) -> None:
    """The factory's engine is made after the deduplicator and never shown to it (no
    sessionmaker bind to read): what the handler really uses is what is watched."""
    ledger = create_ledger(db)
    engines: list[Engine] = []

    def factory() -> Session:
        if not engines:
            engines.append(create_engine(db.url))
        return sessionmaker(engines[0])()

    dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST, session_factory=factory)

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        if message.json().get("commit"):
            if how == "session.commit()":
                session.commit()
            elif how == "COMMIT":
                session.execute(text("COMMIT"))
            else:
                session.connection().commit()

    try:
        results = handle.process_batch([order("c1"), order("c2", commit=True), order("c3")])
        assert_engine_untouched(engines[0])
    finally:
        engines[0].dispose()
    assert [r.outcome for r in results] == [Outcome.PROCESSED, Outcome.FAILED, Outcome.PROCESSED]
    assert isinstance(results[1].error, CommitInHandler), results[1].reason
    assert effects(db, ledger) == ["c1", "c3"]


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_the_deduplicators_own_sessions_outside_a_handler_commit_freely(db: Database) -> None:
    """The default factory's sessions and its engine copy carry the listeners from the start:
    another of its sessions, used while a handler runs in another thread, is not guarded."""
    ledger = create_ledger(db)
    dedup = Deduplicator(db.engine, "c", tables=db.tables, retry=FAST)
    inside, release = threading.Event(), threading.Event()
    outcome: list[Outcome] = []

    @dedup.handler
    def handle(message: Message, session: Session) -> None:
        session.execute(text(f"INSERT INTO {ledger} (message_id) VALUES (:m)"), {"m": message.id})
        if message.json().get("commit"):
            session.commit()
        inside.set()
        assert release.wait(60)

    worker = threading.Thread(target=lambda: outcome.append(handle(order("m1"))))
    worker.start()
    try:
        assert inside.wait(60)
        with dedup.session_factory() as other:
            other.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('other')"))
            other.commit()
            other.execute(text(f"INSERT INTO {ledger} (message_id) VALUES ('other-conn')"))
            other.connection().commit()
    finally:
        release.set()
        worker.join(60)
    assert outcome == [Outcome.PROCESSED]
    assert_engine_untouched(db.engine)
    refused = handle.process(order("m2", commit=True))  # and the guard holds on the copy
    assert refused.outcome is Outcome.FAILED and isinstance(refused.error, CommitInHandler)
    assert sorted(effects(db, ledger)) == ["m1", "other", "other-conn"]
