"""Databases for the outbox's tests: ``server`` is the two servers with true concurrent
writers (PostgreSQL, MariaDB), ``mariadb`` MariaDB alone; a module whose ``db`` tests run on
MariaDB too defines ``db`` over ``installed`` with the three kinds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import database


def installed(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> Iterator[Any]:
    """``kind``'s database (tests.conftest.database), the library's tables installed."""
    yield from database(request, kind, tmp_path)


@pytest.fixture(params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A database server with concurrent writers: PostgreSQL, MariaDB."""
    yield from installed(request, request.param, tmp_path)


@pytest.fixture
def mariadb(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    yield from installed(request, "mariadb", tmp_path)
