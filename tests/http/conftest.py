"""The servers the shared HTTP suite (test_idempotency.py) runs against.

SERVERS lists them; each entry says how to start one (a module-scoped
process, restartable for the SIGKILL tests) and which database to count in.
To add a store or a server (Redis, WSGI), append a ServerKind whose app
serves the routes tests/http/asgi_apps.py documents.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, text

from consumerdedup.schema import Tables, install
from tests.http import wsgi_server
from tests.http.asgi_apps import count_runs, tables_for
from tests.http.stores import drop_redis_keys, redis_env
from tests.support import mariadb_service

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = 30.0


@dataclass(frozen=True)
class ServerKind:
    name: str
    database: str  # "postgresql", "sqlite" or "mariadb"
    env: dict[str, str] = field(default_factory=dict)
    command: Callable[[int], list[str]] | None = None
    """argv for a server on this port; default: uvicorn with tests.http.asgi_apps:make_app."""
    transactional: bool = True
    """Serves /tx/payments (SQL stores only)."""


def flask_waitress(port: int) -> list[str]:
    return wsgi_server.command("tests.http.wsgi_apps:make_app", port)


def uvicorn(port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "--factory", "tests.http.asgi_apps:make_app",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip


SERVERS: list[ServerKind] = [
    ServerKind("fastapi-postgresql-async", "postgresql", {"CDD_HTTP_FRAMEWORK": "fastapi",
                                                         "CDD_HTTP_ASYNC": "1"}),
    ServerKind("raw-postgresql-sync", "postgresql", {"CDD_HTTP_FRAMEWORK": "raw"}),
    ServerKind("fastapi-sqlite-sync", "sqlite", {"CDD_HTTP_FRAMEWORK": "fastapi"}),
    # The Redis store (transactional routes stay on the engine's SQL store), and the WSGI
    # middleware under waitress with a Flask app (tests/http/wsgi_apps.py).
    ServerKind("fastapi-redis-async", "postgresql", {"CDD_HTTP_FRAMEWORK": "fastapi",
                                                    "CDD_HTTP_ASYNC": "1", **redis_env()}),
    ServerKind("flask-waitress-postgresql", "postgresql", command=flask_waitress),
    ServerKind("flask-waitress-redis-sqlite", "sqlite", redis_env(), command=flask_waitress),
    # MariaDB: the SQL store's claim by INSERT ... ON DUPLICATE KEY UPDATE (docs/databases.md).
    ServerKind("raw-mariadb-sync", "mariadb", {"CDD_HTTP_FRAMEWORK": "raw"}),
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process over one database; ``runs(route)`` counts the endpoint's runs there."""

    def __init__(self, kind: ServerKind, url: str, schema: str, markers: Path) -> None:
        self.kind = kind
        self.db_url = url
        self.schema = schema
        self.markers = markers
        self.log = markers.parent / "server.log"
        self.tables, self.runs_table = tables_for(schema)
        self.engine: Engine = create_engine(url)
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        env = {**os.environ, **self.kind.env, "CDD_HTTP_DB": self.db_url}
        env |= {"CDD_HTTP_SCHEMA": self.schema, "CDD_HTTP_MARKERS": str(self.markers)}
        env["CDD_HTTP_LOG"] = str(self.log)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        argv = (self.kind.command or uvicorn)(self.port)
        self.process = subprocess.Popen(argv, env=env, cwd=ROOT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.kind.name} server exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)  # polling a port that is not open yet, bounded by the deadline
        raise RuntimeError(f"{self.kind.name} server did not answer within {START_TIMEOUT} s")

    def kill(self) -> None:
        """SIGKILL: the worker dies mid-request with no cleanup of any kind."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def runs(self, route: str, note: str | None = None) -> int:
        return count_runs(self.engine, self.runs_table, route, note)

    def count(self, sql: str) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql)).scalar_one())

    def qualified(self, name: str) -> str:
        return f"{self.schema}.{name}" if self.schema else name


@pytest.fixture(scope="module", params=SERVERS, ids=lambda k: k.name)
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    kind: ServerKind = request.param
    try:
        yield from serve(request, kind)
    finally:
        if "CDD_HTTP_REDIS_PREFIX" in kind.env:
            drop_redis_keys(kind.env["CDD_HTTP_REDIS_PREFIX"])


def serve(request: pytest.FixtureRequest, kind: ServerKind) -> Iterator[Server]:
    """A started server of ``kind`` on a database of its own (a SQLite file in WAL mode, or
    a PostgreSQL schema), its tables installed; stopped and its database dropped after."""
    with tempfile.TemporaryDirectory() as tmp:
        if kind.database == "sqlite":
            url, schema = f"sqlite:///{tmp}/http.db", ""
            with create_engine(url).connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        elif kind.database == "mariadb":  # a database of its own (MySQL's schema)
            yield from _serve_mariadb(request, kind, Path(tmp))
            return
        else:
            url = request.getfixturevalue("postgres_url")
            schema = f"h_{uuid.uuid4().hex[:12]}"
        markers = Path(tmp) / "markers"
        markers.mkdir()
        server = Server(kind, url, schema, markers)
        install(server.engine, server.tables)
        server.runs_table.create(server.engine)
        server.start()
        try:
            yield server
        finally:
            server.stop()
            if schema:
                with server.engine.begin() as conn:
                    conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
            server.engine.dispose()


def _serve_mariadb(request: pytest.FixtureRequest, kind: ServerKind, tmp: Path) -> Iterator[Server]:
    with mariadb_service.isolated_database(request.getfixturevalue("mariadb_url")) as name:
        url = mariadb_service.in_database(request.getfixturevalue("mariadb_url"), name)
        markers = tmp / "markers"
        markers.mkdir()
        server = Server(kind, url, name, markers)
        install(server.engine, server.tables)
        server.runs_table.create(server.engine)
        server.start()
        try:
            yield server
        finally:
            server.stop()
            server.engine.dispose()


def serve_wsgi(
    folder: Path, app: str, prefix: str
) -> Iterator[tuple[wsgi_server.WsgiServer, Path]]:
    """``app`` ("module:factory") under waitress on a SQLite store of its own in ``folder``:
    the factory reads the store's URL from ``{prefix}_DB`` and appends each run's name to
    the file at ``{prefix}_RUNS``, which is yielded with the server (``runs_in`` counts)."""
    url = f"sqlite:///{folder / 'keys.db'}"
    install(create_engine(url), Tables.define())
    runs = folder / "runs.txt"
    runs.touch()
    env = {f"{prefix}_DB": url, f"{prefix}_RUNS": str(runs)}
    with wsgi_server.WsgiServer(app, env) as running:
        yield running, runs


def runs_in(runs: Path, name: str) -> int:
    """How many times the app of ``serve_wsgi`` ran ``name``."""
    return runs.read_text().splitlines().count(name)


def new_key() -> str:
    return uuid.uuid4().hex


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
