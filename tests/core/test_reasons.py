"""describe() keeps the names a user needs and masks the values (issue 23 item 5, invariant 6).

Every error here comes from the real PostgreSQL server, through SQLAlchemy with the
secret as a bound parameter, or from a real connection attempt with the secret as the
password: a generated secret placed in a value position (a unique key, a row a check, a
not-null or a foreign key rejects, an input the server cannot parse, a password) never
appears in describe()'s text, while the names (constraint, relation, column, type,
database, role, host, port) do, and a setup fault says what to do.
"""

from __future__ import annotations

import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy.exc
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from consumerdedup.reasons import describe, mask_passwords

pytestmark = pytest.mark.postgres

SECRETS = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
    min_size=6,
    max_size=40,
).filter(lambda s: len(s.strip()) >= 6)
EXAMPLES = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CLOSED_PORT = 1


@pytest.fixture(scope="module")
def probe(postgres_url: str) -> Iterator[tuple[Engine, str]]:
    engine = create_engine(postgres_url)
    schema = f"cdd_reasons_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        for statement in (
            f"CREATE SCHEMA {schema}",
            f"CREATE TABLE {schema}.accounts (id SERIAL PRIMARY KEY, card TEXT "
            "CONSTRAINT accounts_card_key UNIQUE, amount INTEGER CONSTRAINT amount_positive "
            "CHECK (amount > 0), owner TEXT NOT NULL DEFAULT 'x')",
            f"CREATE TABLE {schema}.charges (card TEXT CONSTRAINT charges_card_fkey "
            f"REFERENCES {schema}.accounts (card))",
        ):
            conn.exec_driver_sql(statement)
    yield engine, schema
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
    engine.dispose()


def failure(engine: Engine, *steps: tuple[str, dict[str, Any]]) -> sqlalchemy.exc.DBAPIError:
    """The error the last step raises, in a transaction rolled back."""
    with engine.connect() as conn:
        try:
            for sql, params in steps:
                conn.execute(text(sql), params)
        except sqlalchemy.exc.DBAPIError as error:
            return error
        finally:
            conn.rollback()
    raise AssertionError("no error")


def assert_hidden(secret: str, reason: str, *, baseline: str) -> None:
    note(reason)
    assume(secret not in baseline and " ".join(secret.split()) not in baseline)
    for form in {secret, " ".join(secret.split()), urllib.parse.quote(secret, safe="")}:
        assert form not in reason, reason


STATEMENTS = {
    "unique": (
        ["INSERT INTO {s}.accounts (card, amount) VALUES (:v, 1)"] * 2,
        ['duplicate key value violates unique constraint "accounts_card_key"', "23505"],
    ),
    "check": (
        ["INSERT INTO {s}.accounts (card, amount) VALUES (:v, -1)"],
        ['new row for relation "accounts" violates check constraint "amount_positive"'],
    ),
    "not-null": (
        ["INSERT INTO {s}.accounts (card, amount, owner) VALUES (:v, 1, NULL)"],
        ['null value in column "owner" of relation "accounts" violates not-null constraint'],
    ),
    "foreign-key": (
        ["INSERT INTO {s}.charges (card) VALUES (:v)"],
        ['insert or update on table "charges" violates foreign key constraint "charges_card_fkey"'],
    ),
    "invalid-integer": (
        ["SELECT CAST(:v AS INTEGER)"],
        ["invalid input syntax for type integer", "22P02"],
    ),
    "invalid-date": (["SELECT CAST(:v AS DATE)"], ["for type date"]),
}


@pytest.mark.parametrize("case", sorted(STATEMENTS))
@EXAMPLES
@given(secret=SECRETS)
def test_a_secret_in_a_value_position_never_shows_and_the_names_do(
    probe: tuple[Engine, str], case: str, secret: str
) -> None:
    engine, schema = probe
    sqls, names = STATEMENTS[case]

    def reason(value: str) -> str:
        steps = [(sql.format(s=schema), {"v": value}) for sql in sqls]
        return describe(failure(engine, *steps))

    if case.startswith("invalid"):  # a secret the server can read as the type raises nothing
        assume(not secret.strip().lstrip("+-").isdigit())
        if case == "invalid-date":
            assume(not any(c.isdigit() for c in secret))
            # PostgreSQL's special date inputs ('infinity', 'epoch', 'today', ...) are dates
            special = {"infinity", "-infinity", "+infinity", "epoch", "today", "tomorrow"}
            assume(secret.strip().lower() not in special | {"yesterday", "now", "allballs"})
    baseline = reason("zz-baseline")
    got = reason(secret)
    assert_hidden(secret, got, baseline=baseline)
    assert got == baseline  # nothing of the value is left, not even its length
    for name in names:
        assert name in got, got
    assert "[parameters" not in got and "DETAIL" not in got


@EXAMPLES
@given(secret=SECRETS)
def test_a_password_never_shows_on_a_wrong_database_role_or_port(
    postgres_url: str, secret: str
) -> None:
    url = make_url(postgres_url)
    role = f"nobody_{uuid.uuid4().hex[:6]}"
    cases = {
        "database": (url.set(database="no_such_db"), ['database "no_such_db" does not exist']),
        "role": (url.set(username=role), [f'role "{role}" does not exist', "user (role)"]),
        "port": (url.set(port=CLOSED_PORT), [f"port {CLOSED_PORT} failed: Connection refused"]),
    }
    for target, names in cases.values():
        engine = create_engine(target.set(password=secret))
        try:
            with pytest.raises(sqlalchemy.exc.OperationalError) as caught:
                engine.connect()
        finally:
            engine.dispose()
        got = describe(caught.value)
        assert_hidden(secret, got, baseline=names[0])
        for name in [*names, f'"{url.host}"']:
            assert name in got, got
        assert "check the" in got, got  # the fix


@EXAMPLES
@given(secret=SECRETS)
def test_a_password_in_a_url_or_a_conninfo_is_masked_wherever_it_stands(secret: str) -> None:
    quoted = urllib.parse.quote(secret, safe="")
    kv = "'" + secret.replace("\\", "\\\\").replace("'", "\\'") + "'"
    for form in (
        "cannot connect to postgresql://alice:{}@db.example:5433/ledger now",
        "cannot connect to amqp://guest:{}@mq.example:5672/%2F now",
        "host=db.example port=5433 dbname=ledger user=alice password={} sslmode=require",
    ):
        carrier = form.format(kv if "password=" in form else quoted)
        got = describe(RuntimeError(carrier))
        assert_hidden(secret, got, baseline=mask_passwords(form.format("zz-baseline")))
        assert got == "RuntimeError: " + mask_passwords(form.format("zz-baseline"))
        for name in ("alice" if "alice" in carrier else "guest", "example"):
            assert name in got, got


def test_the_setup_errors_name_the_object_and_the_fix(probe: tuple[Engine, str]) -> None:
    engine, schema = probe
    got = describe(failure(engine, ("SELECT * FROM ledger.accounts", {})))
    assert got == (
        'ProgrammingError: relation "ledger.accounts" does not exist: run your migrations; '
        "consumerdedup's own tables: consumerdedup init-db (SQLSTATE 42P01)"
    )
    got = describe(failure(engine, (f"SELECT nope FROM {schema}.accounts", {})))
    assert 'column "nope" does not exist: run your migrations' in got, got


def test_a_message_we_do_not_know_keeps_nothing_quoted(probe: tuple[Engine, str]) -> None:
    """A function's own RAISE (SQLSTATE P0001) is not a template: all quoted text goes, and
    a quoted value that looks like a template inside is not taken for one."""
    engine, _ = probe
    value = 'relation "4111111111111111" does not exist'
    got = describe(failure(engine, ("SELECT CAST(:v AS INTEGER)", {"v": value})))
    assert "4111" not in got and "invalid input syntax for type integer" in got, got
