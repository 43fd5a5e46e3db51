"""Round-4 holes in consumerdedup.http, through a real uvicorn server and httpx.

The app (``make_app``) is a raw ASGI app over the suite's Backend (tests/http/asgi_apps.py):
  /crlf          answers 201 with a header value holding CR LF: a response no server can
                 send again, so it must be recorded as not stored (a retry is refused with
                 409 response-not-stored, never run again)
  /tx/rollback   transactional; ?role=first writes a run, rolls the request's session back
                 (which ends the transaction its claim lived in), drops a marker file, waits
                 until a twin with the same key has run, writes again and answers 201: it
                 must answer 500 claim-lost and commit nothing. ?role=twin writes a run and
                 answers 201 (it may claim the key: the first's claim is gone).
                 ?role=hold writes a run and keeps its transaction open until GET /release
  GET /release   passes through; lets the holder with ?tag= answer
``make_wsgi_app`` serves /tx/rollback (roles first and twin) under Flask and
WSGIIdempotencyMiddleware (waitress): the rollback must end the same way there.
On SQLite a transactional request holds the database's write lock: another key's
transactional request is refused with 409 store-busy, whose detail says SQLite
serialises writers (not a false in-flight: the key may be free).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncSession

from consumerdedup.http import IdempotencyMiddleware, IdempotencyPolicy, RoutePolicy
from consumerdedup.http.asgi import SESSION_KEY
from tests.http import wsgi_server
from tests.http.asgi_apps import Backend, _answer, _read
from tests.http.conftest import Server, ServerKind, new_key, serve, wait_for

POLICY = IdempotencyPolicy.of(
    {"/tx/*": RoutePolicy(required=True, transactional=True)},
    default=RoutePolicy(required=True),
)


def make_app() -> Any:
    backend = Backend()
    markers = Path(os.environ["CDD_HTTP_MARKERS"])
    twins: dict[str, asyncio.Event] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await _read(receive)
        path = scope["path"]
        query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
        if path == "/health":
            await _answer(send, 200, {"ok": True})
            return
        route = path.strip("/")
        if path == "/release":  # GET: passes through the middleware
            twins.setdefault(query["tag"], asyncio.Event()).set()
            await _answer(send, 200, {"ok": True})
            return
        if path == "/crlf":
            run = await backend.record(route, None, "")
            headers = [(b"content-type", b"text/plain"), (b"x-note", b"a\r\nx-injected: 1")]
            await send({"type": "http.response.start", "status": 201, "headers": headers})
            await send({"type": "http.response.body", "body": str(run).encode()})
            return
        session = scope[SESSION_KEY]
        tag = query["tag"]
        twin = twins.setdefault(tag, asyncio.Event())
        run = await backend.record_in(session, route, None, query["role"])
        if query["role"] == "hold":  # holds its transaction open until GET /release
            (markers / f"holding-{tag}").touch()
            await asyncio.wait_for(twin.wait(), 20)
            await _answer(send, 201, {"run": run})
            return
        if query["role"] == "twin":
            twin.set()
            await _answer(send, 201, {"run": run})
            return
        if isinstance(session, AsyncSession):
            await session.rollback()
        else:
            await asyncio.to_thread(session.rollback)
        (markers / f"rolled-back-{tag}").touch()
        await asyncio.wait_for(twin.wait(), 20)
        run = await backend.record_in(session, route, None, "first-again")
        await _answer(send, 201, {"run": run})

    return IdempotencyMiddleware(app, backend.engine, policy=POLICY, tables=backend.tables)


def make_wsgi_app() -> Any:
    """/tx/rollback (roles first and twin) under Flask, for WSGIIdempotencyMiddleware."""
    from flask import Flask, jsonify, request
    from sqlalchemy import insert

    from consumerdedup.http.wsgi import WSGIIdempotencyMiddleware

    backend = Backend()  # blocking: CDD_HTTP_ASYNC is not set for the WSGI kinds
    markers = Path(os.environ["CDD_HTTP_MARKERS"])
    twins: dict[str, threading.Event] = {}
    twins_lock = threading.Lock()
    app = Flask("consumerdedup-attack-round4")

    def record(session: Any, note: str) -> int:
        row = {"route": "tx/rollback", "principal": None, "note": note}
        run = session.execute(insert(backend.runs).values(row)).inserted_primary_key[0]
        backend.outbox.add(session, "payments", note.encode())
        return int(run)

    @app.get("/health")
    def health() -> Any:
        return jsonify(ok=True)

    @app.post("/tx/rollback")
    def rollback() -> Any:
        session = request.environ[SESSION_KEY]
        role, tag = request.args["role"], request.args["tag"]
        with twins_lock:
            twin = twins.setdefault(tag, threading.Event())
        run = record(session, role)
        if role == "twin":
            twin.set()
            return jsonify(run=run), 201
        session.rollback()  # ends the transaction the claim lived in
        (markers / f"rolled-back-{tag}").touch()
        if not twin.wait(20):
            raise RuntimeError("the twin never ran")
        return jsonify(run=record(session, "first-again")), 201

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, backend.engine, policy=POLICY, tables=backend.tables
    )
    return app


def _waitress(port: int) -> list[str]:
    return wsgi_server.command("tests.http.test_attack_round4:make_wsgi_app", port)


def _uvicorn(port: int) -> list[str]:
    from tests.http.conftest import uvicorn

    argv = uvicorn(port)
    argv[argv.index("tests.http.asgi_apps:make_app")] = "tests.http.test_attack_round4:make_app"
    return argv


KINDS = [
    ServerKind("round4-postgresql-async", "postgresql", {"CDD_HTTP_ASYNC": "1"}, _uvicorn),
    ServerKind("round4-postgresql-sync", "postgresql", {}, _uvicorn),
    ServerKind("round4-sqlite-sync", "sqlite", {}, _uvicorn),
]
WSGI_KINDS = [
    ServerKind("round4-waitress-postgresql", "postgresql", {}, _waitress),
    ServerKind("round4-waitress-sqlite", "sqlite", {}, _waitress),
]


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def attacked(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=KINDS + WSGI_KINDS, ids=lambda k: k.name)
def rolled_back(request: pytest.FixtureRequest) -> Iterator[Server]:
    """Every server, the WSGI ones too (they serve /tx/rollback only)."""
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=KINDS[2:], ids=lambda k: k.name)
def attacked_sqlite(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The SQLite server only (SQLite serialises writers; PostgreSQL never does this)."""
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=KINDS[:2], ids=lambda k: k.name)
def attacked_postgresql(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The PostgreSQL servers only (on SQLite even a replay's claim takes the one write lock,
    so concurrent replays may answer 409 store-busy: docs/http.md)."""
    yield from serve(request, request.param)


def test_a_response_with_a_header_no_server_can_replay_is_never_run_again(
    attacked: Server,
) -> None:
    key = {"Idempotency-Key": new_key()}
    with httpx.Client(base_url=attacked.url, timeout=10) as client:
        with contextlib.suppress(httpx.HTTPError):  # the server may refuse to send it
            client.post("/crlf", content=b"{}", headers=key)
        retries = [client.post("/crlf", content=b"{}", headers=key) for _ in range(2)]
    for retry in retries:
        assert retry.status_code == 409, retry.text
        assert retry.json()["type"].endswith(":response-not-stored")
    assert attacked.runs("crlf") == 1


def test_an_endpoint_that_rolls_back_its_session_commits_nothing_beside_a_twin(
    rolled_back: Server,
) -> None:
    attacked = rolled_back
    key = {"Idempotency-Key": new_key()}
    tag = uuid.uuid4().hex[:8]
    answers: dict[str, httpx.Response] = {}

    def send(role: str) -> None:
        with httpx.Client(base_url=attacked.url, timeout=30) as client:
            answers[role] = client.post(
                f"/tx/rollback?role={role}&tag={tag}", content=b"{}", headers=key
            )

    first = threading.Thread(target=send, args=("first",))
    first.start()
    marker = attacked.markers / f"rolled-back-{tag}"
    wait_for(marker.exists, 20, "the first request to roll its session back")
    send("twin")  # the first's claim went with its transaction: the twin claims and runs
    first.join(30)
    assert not first.is_alive()
    assert answers["twin"].status_code == 201, answers["twin"].text
    assert answers["first"].status_code == 500, answers["first"].text
    assert answers["first"].json()["type"].endswith(":claim-lost")
    # Only the twin's run committed: nothing the first wrote, before or after its rollback.
    assert attacked.runs("tx/rollback", "twin") == 1
    assert attacked.runs("tx/rollback", "first") == 0
    assert attacked.runs("tx/rollback", "first-again") == 0
    with httpx.Client(base_url=attacked.url, timeout=10) as client:
        again = client.post(f"/tx/rollback?role=twin&tag={tag}", content=b"{}", headers=key)
    assert again.status_code == 201  # the twin's response, replayed (its request)
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == answers["twin"].content


def test_sqlite_answers_store_busy_not_in_flight_for_another_key(attacked_sqlite: Server) -> None:
    attacked = attacked_sqlite
    tag = uuid.uuid4().hex[:8]
    answers: dict[str, httpx.Response] = {}

    def hold() -> None:
        with httpx.Client(base_url=attacked.url, timeout=30) as client:
            answers["hold"] = client.post(
                f"/tx/rollback?role=hold&tag={tag}",
                content=b"{}",
                headers={"Idempotency-Key": new_key()},
            )

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        wait_for((attacked.markers / f"holding-{tag}").exists, 20, "the holder's transaction")
        with httpx.Client(base_url=attacked.url, timeout=10) as client:
            other = client.post(
                f"/tx/rollback?role=twin&tag={tag}-other",
                content=b"{}",
                headers={"Idempotency-Key": new_key()},
            )
    finally:
        httpx.get(f"{attacked.url}/release?tag={tag}", timeout=10)
        holder.join(30)
    assert other.status_code == 409, other.text  # like a twin's: retry later
    assert other.json()["type"].endswith(":store-busy")
    assert "SQLite" in other.json()["detail"]
    assert other.headers["retry-after"] == "1"
    assert answers["hold"].status_code == 201
    assert attacked.runs("tx/rollback", "twin") == 0


def test_concurrent_retries_of_a_finished_transactional_request_all_replay(
    attacked_postgresql: Server,
) -> None:
    """Ten retries at once of a completed key: each replays (found running
    examples/http_payments.py: with the key's advisory lock taken by one retry reading the
    record, the others answered 409 in-flight)."""
    attacked = attacked_postgresql
    key = {"Idempotency-Key": new_key()}
    url = f"/tx/rollback?role=twin&tag={uuid.uuid4().hex[:8]}"

    async def retries() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=attacked.url, timeout=30) as client:
            first = await client.post(url, content=b"{}", headers=key)
            again = await asyncio.gather(
                *(client.post(url, content=b"{}", headers=key) for _ in range(10))
            )
            return first, list(again)

    first, again = asyncio.run(retries())
    assert first.status_code == 201
    assert [r.status_code for r in again] == [201] * 10, [r.text for r in again]
    assert all(r.headers["idempotent-replayed"] == "true" for r in again)
    assert all(r.content == first.content for r in again)
