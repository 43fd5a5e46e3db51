"""Round 9, fresh eyes on the HTTP options (issue 38 items 1, 4, 7): two routes of one
path, one per method, each marked ``@idempotent``, through uvicorn on PostgreSQL.

Seen failing before the fix: the policy was chosen by path alone (the first route whose
pattern matched), so with ``POST /items`` marked first, ``PATCH /items`` (marked
``@idempotent(methods=["PATCH"], required=True)``) passed through untouched: no key
required, and one key ran the endpoint twice (Invariant 9).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from consumerdedup.http import IdempotencyMiddleware, idempotent
from tests.conftest import Database

runs: list[str] = []


@idempotent(required=True)
async def create_item(request: Request) -> JSONResponse:
    runs.append("POST")
    return JSONResponse({"created": len(runs)}, status_code=201)


@idempotent(methods=["PATCH"], required=True)
async def update_item(request: Request) -> JSONResponse:
    runs.append("PATCH")
    return JSONResponse({"updated": len(runs)})


@pytest.fixture
def server(pg: Database) -> Iterator[str]:
    app = Starlette(
        routes=[
            Route("/items", create_item, methods=["POST"]),
            Route("/items", update_item, methods=["PATCH"]),
        ]
    )
    wrapped = IdempotencyMiddleware(app, pg.engine, routes=app.routes, tables=pg.tables)
    config = uvicorn.Config(wrapped, host="127.0.0.1", port=0, log_level="warning")
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not served.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    port = served.servers[0].sockets[0].getsockname()[1]
    runs.clear()
    yield f"http://127.0.0.1:{port}"
    served.should_exit = True
    thread.join(30)


def test_each_method_of_one_path_keeps_its_own_policy(server: str) -> None:
    key = {"Idempotency-Key": f"k-{uuid.uuid4()}"}
    with httpx.Client(base_url=server, timeout=30) as client:
        assert client.post("/items", json={"a": 1}).status_code == 400  # required
        assert client.patch("/items", json={"a": 1}).status_code == 400  # required too
        first = client.patch("/items", json={"a": 1}, headers=key)
        again = client.patch("/items", json={"a": 1}, headers=key)
        assert first.status_code == again.status_code == 200
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.json() == first.json()
        posted = client.post("/items", json={"a": 1}, headers=key)  # another scope: runs
        assert posted.status_code == 201
    assert runs == ["PATCH", "POST"]
