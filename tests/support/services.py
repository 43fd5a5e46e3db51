"""Find the real services the integration tests talk to, or say how to provide one.

Order: an explicit URL in an environment variable; the local default address
if it answers; testcontainers when a Docker engine answers; otherwise skip,
or fail when CI asks for every service (``required()``).

Every skip of the suite goes through ``unavailable`` with a reason that says what
is missing and how to provide it; tests/conftest.py turns any skip that gets past
it into a failure as well when ``required()``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
from typing import NoReturn

import pytest

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def required() -> bool:
    """True in CI: CONSUMERDEDUP_REQUIRE_SERVICES set (not 0), or CI=true (as CI services set
    it). Then nothing may be skipped: a missing service or tool is a failure."""
    flag = os.environ.get("CONSUMERDEDUP_REQUIRE_SERVICES", "")
    return flag not in ("", "0") or os.environ.get("CI", "").lower() in ("true", "1", "yes")


REQUIRED_NOTE = "CI or CONSUMERDEDUP_REQUIRE_SERVICES is set, so this is a failure"


def unavailable(reason: str) -> NoReturn:
    """Skip the test for ``reason`` (what is missing, how to provide it); in CI, fail it."""
    if required():
        pytest.fail(f"{reason} ({REQUIRED_NOTE})")
    pytest.skip(reason)


def tool(name: str, why: str) -> str:
    """The path of command-line tool ``name``, or ``unavailable`` saying ``why`` it is needed."""
    path = shutil.which(name)
    if path is None:
        unavailable(f"{name} is not on this host: {why}")
    return path


def answers(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def postgres_url() -> str:
    """A SQLAlchemy URL (psycopg 3 driver) of a PostgreSQL server the tests may use."""
    url = os.environ.get("CONSUMERDEDUP_TEST_PG_URL")
    if url:
        return url
    if answers("127.0.0.1", 5432):
        return PG_DEFAULT
    if docker_answers():
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver="psycopg")
        container.start()
        atexit.register(container.stop)
        return str(container.get_connection_url())
    unavailable(
        "no PostgreSQL: set CONSUMERDEDUP_TEST_PG_URL, start one on 127.0.0.1:5432, "
        "or run a Docker engine for testcontainers"
    )
