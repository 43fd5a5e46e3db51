"""Passwords are masked where they stand, never by replacing their text everywhere.

A one-letter password used to garble every word holding that letter:
``postgresql`` became ``postgr***sql`` and "Connection refused" lost its e's.
"""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from consumerdedup.cli.redact import Secrets, mask
from tests.cli.test_commands import cli

REFUSED = "connection failed: connection to server at"
REFUSED_PORT = "port 1 failed: Connection refused: check the host and port in the URL (127.0.0.1:1)"


@pytest.fixture
def schema(pg_schema: str) -> str:
    return pg_schema


@pytest.mark.postgres
def test_a_one_letter_password_is_masked_in_the_url_only(postgres_url: str, schema: str) -> None:
    url = make_url(postgres_url).set(drivername="postgresql", password="e")
    given = url.render_as_string(hide_password=False)  # trust auth ignores the password
    tables = ["--processed-events-table", f"{schema}.pe", "--outbox-table", f"{schema}.ob"]
    run = cli("init-db", "--db", given, *tables)
    assert run.code == 0, run.err
    expected = url.set(drivername="postgresql+psycopg").render_as_string(hide_password=True)
    assert run.out == (
        f"created {schema}.pe, {schema}.ob, {schema}.idempotency_keys, {schema}.consumer_offsets "
        f"({expected})\n"
    )
    assert ":***@" in expected


def test_a_one_letter_password_leaves_the_error_message_readable() -> None:
    run = cli("init-db", "--db", "postgresql://alice:e@127.0.0.1:1/x")
    run.assert_one_line_error(1)
    assert REFUSED in run.err and REFUSED_PORT in run.err
    assert "***" not in run.err


def test_a_one_letter_password_in_the_query_leaves_the_traceback_readable() -> None:
    run = cli("stats", "--verbose", "--db", "postgresql://alice@127.0.0.1:1/x?password=e")
    assert run.code == 1
    assert REFUSED in run.err and REFUSED_PORT in run.err and "Traceback" in run.err
    assert "***" not in run.err.replace("password=***", "")
    assert "password=***" in run.err and "password=e" not in run.err  # quoted, masked


def test_passwords_are_masked_where_they_stand() -> None:
    assert mask("postgresql://user:e@host/db") == "postgresql://user:***@host/db"
    assert mask("amqp://guest:p@ss@host:5672/%2F") == "amqp://guest:***@host:5672/%2F"
    assert mask("host=db password=e dbname=x") == "host=db password=*** dbname=x"
    assert mask("dsn='host=db password=\"e e\"'") == "dsn='host=db password=***'"
    assert mask("sqlite:///e.db?mode=ro&sslpassword=e") == "sqlite:///e.db?mode=ro&sslpassword=***"
    untouched = "the server at e.example, user e: password authentication failed"
    assert mask(untouched) == untouched


def test_secrets_mask_a_given_url_wherever_it_is_quoted() -> None:
    secrets = Secrets()
    given = "postgresql://alice:p%2Fss@host/db"  # the password holds a slash
    secrets.add_url(given, make_url(given))
    quoted = f"could not connect to {given}: Connection refused"
    assert secrets.scrub(quoted) == "could not connect to postgresql://alice:***@host/db: " + (
        "Connection refused"
    )
    secrets.add_url("amqp://guest:e@127.0.0.1:1/%2F")
    message = "AMQP connection to amqp://guest:e@127.0.0.1:1/%2F refused, see the server"
    assert secrets.scrub(message) == (
        "AMQP connection to amqp://guest:***@127.0.0.1:1/%2F refused, see the server"
    )


def test_secrets_also_mask_passwords_in_forms_they_were_not_given() -> None:
    """A driver may quote the connection as key=value with the password decoded, and a
    library may log a URL the command was never given: masked in place all the same."""
    secrets = Secrets()
    given = "postgresql://alice:p%40ss@db/x"  # the password is p@ss
    secrets.add_url(given, make_url(given))
    text = "connect(host=db user=alice password=p@ss dbname=x) failed via amqp://bob:s3cret@mq/"
    scrubbed = secrets.scrub(text)
    assert "p@ss" not in scrubbed and "s3cret" not in scrubbed
    assert scrubbed == (
        "connect(host=db user=alice password=*** dbname=x) failed via amqp://bob:***@mq/"
    )


@pytest.mark.postgres
@pytest.mark.parametrize("verbose", [False, True], ids=["normal", "verbose"])
def test_a_password_in_the_query_string_is_never_printed(
    postgres_url: str, schema: str, verbose: bool
) -> None:
    """``?password=...``: SQLAlchemy's hide_password masks only ``user:password@``, so the
    query's password must be masked by us, in the normal output and in the DEBUG lines
    (which quote the URL too). Trust auth ignores the password: the command succeeds."""
    secret = "Qu3ry-S3cret"
    url = (
        make_url(postgres_url).set(drivername="postgresql").update_query_dict({"password": secret})
    )
    tables = ["--processed-events-table", f"{schema}.pe", "--outbox-table", f"{schema}.ob"]
    flags = ["--verbose"] if verbose else []
    run = cli("init-db", *flags, "--db", url.render_as_string(hide_password=False), *tables)
    assert run.code == 0, run.err
    assert secret not in run.out, f"the password is printed in clear: {run.out!r}"
    assert secret not in run.err, "the password is in the log lines"
    assert run.out.startswith(f"created {schema}.pe, {schema}.ob") and "password=***" in run.out
    if verbose:  # the DEBUG line naming the database was printed, masked
        assert "password=***" in run.err, run.err
