"""``IdempotencyMiddleware(app, engine)`` alone (keys optional, POST only, 24 h), and what
the FastAPI dependencies put in the OpenAPI schema."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import create_engine, select

from consumerdedup.http import RoutePolicy
from consumerdedup.http.fastapi import Idempotent, TransactionalSession
from consumerdedup.schema import install
from tests.http.conftest import Server, ServerKind, new_key


def _uvicorn(port: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "--factory", "tests.http.default_app:make_app",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def bare() -> Iterator[Server]:
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{tmp}/bare.db"
        with create_engine(url).connect() as conn:
            conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        (Path(tmp) / "markers").mkdir()
        server = Server(
            ServerKind("bare", "sqlite", command=_uvicorn), url, "", Path(tmp) / "markers"
        )
        install(server.engine, server.tables)
        server.runs_table.create(server.engine)
        server.start()
        try:
            yield server
        finally:
            server.stop()
            server.engine.dispose()


def _post(server: Server, method: str, key: str | None, note: str) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return httpx.request(method, server.url + "/orders", content=note, headers=headers, timeout=30)


def test_the_defaults_deduplicate_a_keyed_post_for_24_hours(bare: Server) -> None:
    key, note = new_key(), new_key()
    first = _post(bare, "POST", key, note)
    again = _post(bare, "POST", key, note)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert bare.runs("orders", note) == 1
    table = bare.tables.idempotency_keys
    with bare.engine.connect() as conn:
        created, expires = conn.execute(
            select(table.c.created_at, table.c.expires_at).where(table.c.key == key)
        ).one()
    # expiry counts from completion: 24 h after the claim plus the endpoint's run time
    assert timedelta(hours=24) <= expires - created < timedelta(hours=24, seconds=5)


def test_the_defaults_leave_unkeyed_posts_and_patch_alone(bare: Server) -> None:
    note, key = new_key(), new_key()
    for _ in range(2):
        assert _post(bare, "POST", None, note).status_code == 201
        assert "idempotent-replayed" not in _post(bare, "PATCH", key, note).headers
    assert bare.runs("orders", note) == 2 and bare.runs("PATCH /orders", note) == 2


def test_the_openapi_schema_says_which_endpoints_are_idempotent() -> None:
    api = FastAPI()

    @api.post("/payments", dependencies=[Idempotent(required=True)])
    def pay() -> None: ...

    @api.post("/notes", dependencies=[Idempotent()])
    def note() -> None: ...

    @api.post("/transfers")
    def transfer(session: Any = TransactionalSession(RoutePolicy(required=True))) -> None: ...  # noqa: B008

    @api.post("/plain")
    def plain() -> None: ...

    paths = api.openapi()["paths"]

    def key_parameter(path: str) -> dict[str, Any] | None:
        found = [p for p in paths[path]["post"].get("parameters", []) if p["in"] == "header"]
        return found[0] if found else None

    for path, required in [("/payments", True), ("/notes", False), ("/transfers", True)]:
        parameter = key_parameter(path)
        assert parameter is not None and parameter["name"] == "Idempotency-Key", path
        assert parameter.get("required", False) is required, path
        assert "retry" in parameter["description"]
    assert key_parameter("/plain") is None
