"""Find the real services the integration tests talk to, or say how to provide one.

Order: an explicit URL in an environment variable; the local default address
if it answers; testcontainers when a Docker engine answers; otherwise skip,
or fail when CONSUMERDEDUP_REQUIRE_SERVICES (set by CI) asks for every service.
"""

from __future__ import annotations

import atexit
import os
import socket
from typing import NoReturn

import pytest

PG_DEFAULT = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def required() -> bool:
    return os.environ.get("CONSUMERDEDUP_REQUIRE_SERVICES", "") not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    if required():
        pytest.fail(f"{reason} (CONSUMERDEDUP_REQUIRE_SERVICES is set, so this is a failure)")
    pytest.skip(reason)


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
