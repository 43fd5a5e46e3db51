"""Round 11 attacks on the HTTP idempotency store's transactional mode on MariaDB: an
endpoint that ends the request's transaction as SQL in a MySQL spelling, or with a
statement that commits implicitly (DDL, LOCK TABLES, SET autocommit).

The transactional route's promise (docs/http.md): nothing that did not complete is
stored, and a crash before the commit leaves no effect. Before the fix, such a statement
committed the endpoint's write with a claim that had no response; the endpoint then
failing left the effect done (found so: ``/*!COMMIT*/`` and the rest got through, the write
committed). Fixed by the same reading of MySQL's SQL as the consumer's guard (control_sql).
The server is round 3's attack app (``/tx/sql-end``: writes,
sends ``?sql=``, then fails with ``?fail=1``), served by uvicorn over MariaDB, blocking
and aiomysql.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.http.conftest import Server, ServerKind, new_key, serve
from tests.http.test_attack_round3 import _keyed, _uvicorn

KINDS = [
    ServerKind("attack-mariadb-sync", "mariadb", {}, _uvicorn),
    ServerKind("attack-mariadb-async", "mariadb", {"CDD_HTTP_ASYNC": "1"}, _uvicorn),
]
# The app reads its query string undecoded: the statements are spelled without spaces
# (a comment is whitespace to the server), sent as they are.
SPELLINGS = [
    "/*!COMMIT*/",
    "/*M!100000COMMIT*/",
    "/*!ROLLBACK*/",
    "SET/**/STATEMENT/**/max_statement_time=100/**/FOR/**/COMMIT",
    "EXECUTE/**/IMMEDIATE/**/'COMMIT'",
    "CREATE/**/TABLE/**/made_by_the_endpoint(a/**/INT)",
    "/*!50000CREATE/**/TABLE/**/made_by_the_endpoint_too(a/**/INT)*/",
    "SET/**/autocommit=1",
    "SET/**/@@session.autocommit=1",
    "FLUSH/**/TABLES",
]


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def attacked(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(request, request.param)  # no application_name: not a MySQL option


@pytest.mark.parametrize("sql", SPELLINGS)
def test_a_transactional_endpoint_that_ends_its_transaction_in_a_mysql_spelling(
    attacked: Server, sql: str
) -> None:
    key = new_key()
    before = attacked.runs("tx/sql-end")  # the server is the module's: earlier tests' runs
    reply = httpx.post(
        attacked.url + f"/tx/sql-end?sql={sql}&fail=1",
        headers=_keyed(key),
        json={},
        timeout=30,
    )
    assert reply.status_code == 500
    assert attacked.runs("tx/sql-end") == before, "the endpoint's write was committed"
    table = attacked.qualified("idempotency_keys")
    keys = attacked.count(f"SELECT count(*) FROM {table} WHERE `key` = '{key}'")
    assert keys == 0, "a claim without its response was committed"


def test_the_route_commits_a_harmless_statement(attacked: Server) -> None:
    """The negative control: the same route with a statement that ends nothing commits
    its write and its response once."""
    key = new_key()
    before = attacked.runs("tx/sql-end")
    reply = httpx.post(
        attacked.url + "/tx/sql-end?sql=SELECT/**/1/*COMMIT*/",
        headers=_keyed(key),
        json={},
        timeout=30,
    )
    assert reply.status_code == 201, reply.text
    assert attacked.runs("tx/sql-end") == before + 1
