"""A setup fault met by our own statements is a ConfigurationError, never a message's failure.

A role without INSERT on processed_events (42501) and a database that refuses writes, as a
read-only standby does (25006, here ``default_transaction_read_only`` set on the role): the
claim (claim-first) or the record (check-first) fails on every message alike. Recording each
message FAILED and dead-lettering it would empty the stream into the dead-letter queue, and
the redeliveries after the fix would answer RecordedFailure. The handler writes nothing, so
the only failing statements are ours. Both deduplicators, both claim modes, PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url

from consumerdedup import ConfigurationError, Message, Result, RetryPolicy
from tests.conftest import Database
from tests.support.flavors import AsyncFlavor, SyncFlavor

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def _role_url(url: str, role: str) -> str:
    return make_url(url).set(username=role, password=None).render_as_string(False)


@pytest.fixture(params=["no-insert", "read-only"])
def restricted(request: pytest.FixtureRequest, pg: Database) -> Iterator[Database]:
    """``pg`` seen through a role of its own (trust auth): one that may read processed_events
    but not insert into it, or one that may do anything in a read-only database session."""
    role = f"cdd_{uuid.uuid4().hex[:10]}"
    table = pg.name("processed_events")
    setup = [f"CREATE ROLE {role} LOGIN", f"GRANT USAGE ON SCHEMA {pg.schema} TO {role}"]
    if request.param == "no-insert":
        setup.append(f"GRANT SELECT ON {table} TO {role}")
    else:
        setup.append(f"GRANT ALL ON ALL TABLES IN SCHEMA {pg.schema} TO {role}")
        setup.append(f"ALTER ROLE {role} SET default_transaction_read_only = on")
    with pg.engine.begin() as conn:
        for statement in setup:
            conn.exec_driver_sql(statement)
    url, async_url = _role_url(pg.url, role), _role_url(pg.async_url, role)
    engine = create_engine(url)
    try:
        yield dataclasses.replace(pg, url=url, async_url=async_url, engine=engine)
    finally:
        engine.dispose()
        with pg.engine.begin() as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")


@pytest.fixture(params=["sync-claim", "sync-check", "async-claim", "async-check"])
def flavor(request: pytest.FixtureRequest, restricted: Database) -> Iterator[Any]:
    kind, mode = request.param.split("-")
    chosen = (SyncFlavor if kind == "sync" else AsyncFlavor)(
        restricted, claim_first=mode == "claim"
    )
    yield chosen
    chosen.close()


@pytest.mark.postgres
def test_our_statements_refused_by_the_setup_are_a_configuration_error(
    pg: Database, restricted: Database, flavor: Any
) -> None:
    assert_configuration_error(pg, flavor)


@pytest.mark.parametrize("kind", ["sync-claim", "sync-check", "async-claim", "async-check"])
def test_a_read_only_sqlite_database_is_a_configuration_error(
    sqlite_db: Database, kind: str
) -> None:
    path = sqlite_db.url.removeprefix("sqlite:///")
    url = f"sqlite:///file:{path}?mode=ro&uri=true"
    engine = create_engine(url)
    read_only = dataclasses.replace(
        sqlite_db, url=url, async_url=url.replace("sqlite:", "sqlite+aiosqlite:", 1), engine=engine
    )
    sync, mode = kind.split("-")
    flavor = (SyncFlavor if sync == "sync" else AsyncFlavor)(read_only, claim_first=mode == "claim")
    try:
        assert_configuration_error(sqlite_db, flavor)
    finally:
        flavor.close()
        engine.dispose()


def assert_configuration_error(db: Database, flavor: Any) -> None:
    dead: list[Result] = []
    handle = flavor.wrap(lambda message: [], consumer="c", retry=FAST, dead_letter=dead.append)
    messages = [Message(id=f"m-{n}", body=b"{}") for n in range(3)]
    for run in (handle.process_batch, lambda batch: [handle.process(batch[0])]):
        try:
            results = run(messages)
        except ConfigurationError as error:
            assert "cannot be used as configured" in str(error), error
            assert "the role's rights" in str(error), error
        else:
            ended = [(r.outcome.name, r.reason) for r in results]
            pytest.fail(f"a setup fault was charged to the messages: {ended}")
    assert dead == []  # nothing dead-lettered, and nothing recorded as failed
    assert db.scalar(f"SELECT count(*) FROM {db.name('processed_events')}") == 0
