"""Round-3 attacks on consumerdedup.http through its public API, with a real server.

Each test was written against the code before its fix and failed there (see the commit
messages). The app (``make_app``, served by uvicorn in a subprocess) is a raw ASGI app
over the suite's Backend (tests/http/asgi_apps.py), with the routes these attacks need:
  /lease-long    lease 1 s; runs ?sleep=S seconds (past its lease: renewals keep it)
  /after-raise   answers 201 completely, then raises (work after the response, as a
                 Starlette BackgroundTask that fails)
  /after-slow    answers 201 completely, then works 5 s more (a slow BackgroundTask)
  /tx/sql-end    transactional: writes, sends ?sql=COMMIT|END as SQL, then answers (or
                 raises, with ?fail=1)
``make_wsgi_app`` serves the same routes under Flask and WSGIIdempotencyMiddleware
(waitress; the work after the response is Flask's call_on_close). The server's PostgreSQL
connections carry an application_name of their own, so a test can
terminate exactly them (and never another process's).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from consumerdedup.http import IdempotencyMiddleware, IdempotencyPolicy, RoutePolicy
from consumerdedup.http.asgi import SESSION_KEY
from consumerdedup.schema import install
from tests.http import wsgi_server
from tests.http.asgi_apps import Backend, _answer, _read
from tests.http.conftest import Server, ServerKind, new_key, serve, wait_for

APP_NAME = "CDD_ATTACK_APP_NAME"
USER_ID = "CDD_ATTACK_USER_ID"
POLICY = IdempotencyPolicy.of(
    {
        "/lease-long": RoutePolicy(required=True, lease=timedelta(seconds=1)),
        "/tx/*": RoutePolicy(required=True, transactional=True),
    },
    default=RoutePolicy(required=True),
)


def make_app() -> Any:
    if name := os.environ.get(APP_NAME):
        url = make_url(os.environ["CDD_HTTP_DB"]).update_query_dict({"application_name": name})
        os.environ["CDD_HTTP_DB"] = url.render_as_string(hide_password=False)
    backend = Backend()

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
        if path.startswith("/tx/"):
            session = scope[SESSION_KEY]
            run = await backend.record_in(session, route, None, "")
            statement = text(query.get("sql", "COMMIT"))
            if isinstance(session, AsyncSession):
                await session.execute(statement)
            else:
                await asyncio.to_thread(session.execute, statement)
            if "fail" in query:  # a crash after the COMMIT got through
                raise RuntimeError("the endpoint failed after its COMMIT")
            await _answer(send, 201, {"run": run})
            return
        run = await backend.record(route, None, "")
        if "sleep" in query:
            await asyncio.sleep(float(query["sleep"]))
        await _answer(send, 201, {"run": run})
        if path == "/after-raise":
            raise RuntimeError("work after the response failed")
        if path == "/after-slow":
            await asyncio.sleep(5)

    user_id = os.environ.get(USER_ID)  # the principal as an int id, as most apps have it
    principal = (lambda scope: int(user_id)) if user_id else None
    return IdempotencyMiddleware(
        app, backend.engine, policy=POLICY, tables=backend.tables, principal=principal
    )


def make_wsgi_app() -> Any:
    """The same routes under Flask, for WSGIIdempotencyMiddleware (served by waitress)."""
    import time

    from flask import Flask, jsonify, request
    from sqlalchemy import insert

    from consumerdedup.http.wsgi import WSGIIdempotencyMiddleware

    if name := os.environ.get(APP_NAME):
        url = make_url(os.environ["CDD_HTTP_DB"]).update_query_dict({"application_name": name})
        os.environ["CDD_HTTP_DB"] = url.render_as_string(hide_password=False)
    backend = Backend()  # blocking: CDD_HTTP_ASYNC is not set for the WSGI kinds
    engine = backend.engine
    assert not isinstance(engine, AsyncEngine)
    app = Flask("consumerdedup-attack-round3")

    def record(route: str) -> int:
        with engine.begin() as conn:
            row = {"route": route, "principal": None, "note": ""}
            result = conn.execute(insert(backend.runs).values(row))
            return int(result.inserted_primary_key[0])  # type: ignore[index]

    @app.get("/health")
    def health() -> Any:
        return jsonify(ok=True)

    @app.post("/<path:path>")
    def endpoint(path: str) -> Any:
        if path.startswith("tx/"):
            session = request.environ[SESSION_KEY]
            row = {"route": path, "principal": None, "note": ""}
            run = session.execute(insert(backend.runs).values(row)).inserted_primary_key[0]
            session.execute(text(request.args.get("sql", "COMMIT")))
            if "fail" in request.args:
                raise RuntimeError("the endpoint failed after its COMMIT")
            return jsonify(run=run), 201
        run = record(path)
        time.sleep(float(request.args.get("sleep", "0")))
        response = jsonify(run=run)
        if path == "after-raise":
            response.call_on_close(_raise_after_the_response)
        if path == "after-slow":
            response.call_on_close(lambda: time.sleep(5))
        return response, 201

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, engine, policy=POLICY, tables=backend.tables
    )
    return app


def _raise_after_the_response() -> None:
    raise RuntimeError("work after the response failed")


def _waitress(port: int) -> list[str]:
    return wsgi_server.command("tests.http.test_attack_round3:make_wsgi_app", port)


def _uvicorn(port: int) -> list[str]:
    from tests.http.conftest import uvicorn

    argv = uvicorn(port)
    argv[argv.index("tests.http.asgi_apps:make_app")] = "tests.http.test_attack_round3:make_app"
    return argv


KINDS = [
    ServerKind("attack-postgresql-async", "postgresql", {"CDD_HTTP_ASYNC": "1"}, _uvicorn),
    ServerKind("attack-postgresql-sync", "postgresql", {}, _uvicorn),
    ServerKind("attack-sqlite-sync", "sqlite", {}, _uvicorn),
    ServerKind("attack-waitress-postgresql", "postgresql", {}, _waitress),
    ServerKind("attack-waitress-sqlite", "sqlite", {}, _waitress),
]


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def attacked(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from _serve(request, request.param)


@pytest.fixture(
    scope="module", params=[k for k in KINDS if k.database == "postgresql"], ids=lambda k: k.name
)
def attacked_postgresql(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The PostgreSQL servers only: for attacks that terminate the server's connections."""
    yield from _serve(request, request.param)


def _serve(request: pytest.FixtureRequest, kind: ServerKind) -> Iterator[Server]:
    """``serve``, the server's connections named (APP_NAME) so an attack can find them."""
    app_name = f"cdd_attack_{uuid.uuid4().hex[:12]}"
    kind = ServerKind(kind.name, kind.database, {**kind.env, APP_NAME: app_name}, kind.command)
    yield from serve(request, kind)


def _keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def test_one_failed_lease_renewal_does_not_let_a_twin_run_beside_the_endpoint(
    attacked_postgresql: Server,
) -> None:
    """The store fails once while the endpoint runs (its pooled connections terminated):
    the renewal must go on, so no twin claims the key while the first still runs."""
    attacked = attacked_postgresql
    key = new_key()
    first: dict[str, int] = {}

    def run_first() -> None:
        reply = httpx.post(
            attacked.url + "/lease-long?sleep=2.5", headers=_keyed(key), json={}, timeout=30
        )
        first["status"] = reply.status_code

    thread = threading.Thread(target=run_first)
    thread.start()
    wait_for(lambda: attacked.runs("lease-long") == 1, what="the first request's run")
    with attacked.engine.connect() as conn:  # before the first renewal (a third of the lease)
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"
            ),
            {"n": attacked.kind.env[APP_NAME]},
        )
    table = attacked.qualified("idempotency_keys")

    def lease() -> Any:
        with attacked.engine.connect() as conn:
            query = f"SELECT locked_until, clock_timestamp() AS now FROM {table} WHERE key = :k"
            return conn.execute(text(query), {"k": key}).one()

    claimed_until = lease().locked_until
    # Touch nothing until the renewal met the terminated connection: renewed since, or lapsed.
    wait_for(
        lambda: (row := lease()).locked_until != claimed_until or row.now > row.locked_until,
        what="the claim renewed or lapsed",
    )
    twins: list[int] = []
    while thread.is_alive():
        reply = httpx.post(
            attacked.url + "/lease-long?sleep=2.5", headers=_keyed(key), json={}, timeout=30
        )
        replayed = reply.headers.get("idempotent-replayed") == "true"
        twins.append(0 if replayed else reply.status_code)  # a replay once the first is done
    thread.join()
    assert attacked.runs("lease-long") == 1, f"a twin ran beside the first; twins got {twins}"
    # A twin whose own claim met a terminated connection got 500 without running: fine.
    assert first["status"] == 201 and 409 in twins and set(twins) <= {0, 409, 500}


def test_work_after_a_complete_response_that_fails_keeps_the_response(attacked: Server) -> None:
    """A complete 201, then the app raises (a failing background task): the client gets the
    201 it was sent, and the retry replays it; the endpoint never runs twice."""
    key = new_key()
    first = httpx.post(attacked.url + "/after-raise", headers=_keyed(key), json={}, timeout=30)
    retry = httpx.post(attacked.url + "/after-raise", headers=_keyed(key), json={}, timeout=30)
    assert attacked.runs("after-raise") == 1
    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry.headers["idempotent-replayed"] == "true" and retry.content == first.content


def test_work_after_a_complete_response_does_not_hold_it_back(attacked: Server) -> None:
    """A complete response leaves when it is complete (and stored), not when the app's slow
    after-work (5 s) ends."""
    key = new_key()
    reply = httpx.post(attacked.url + "/after-slow", headers=_keyed(key), json={}, timeout=2.5)
    assert reply.status_code == 201
    retry = httpx.post(attacked.url + "/after-slow", headers=_keyed(key), json={}, timeout=2.5)
    assert retry.headers["idempotent-replayed"] == "true"
    assert attacked.runs("after-slow") == 1


@pytest.mark.parametrize("sql", ["COMMIT", "END"])
def test_a_transactional_endpoint_that_sends_commit_as_sql_leaves_nothing(
    attacked: Server, sql: str
) -> None:
    """COMMIT sent as SQL committed the write with a claim that has no response; the endpoint
    then failing left the effect done and the key in flight, and the retry after the lease
    ran it again (two effects). Refused like commit(): nothing is kept."""
    key = new_key()
    reply = httpx.post(
        attacked.url + f"/tx/sql-end?sql={sql}&fail=1", headers=_keyed(key), json={}, timeout=30
    )
    assert reply.status_code == 500
    assert attacked.runs("tx/sql-end") == 0, "the endpoint's write was committed"
    table = attacked.qualified("idempotency_keys")
    keys = attacked.count(f"SELECT count(*) FROM {table} WHERE key = '{key}'")
    assert keys == 0, "a claim without its response was committed"


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_store_that_is_down_is_a_503_problem_and_nothing_runs(kind: ServerKind) -> None:
    """The records' database unreachable (PostgreSQL: a closed port; SQLite: a file in a
    directory that does not exist): the keyed request is refused with a 503 problem the
    client can act on (Retry-After), not a bare 500, and the endpoint does not run."""
    with tempfile.TemporaryDirectory() as tmp:
        if kind.database == "sqlite":
            url = f"sqlite:///{tmp}/missing/http.db"
        else:
            url = "postgresql+psycopg://postgres@127.0.0.1:9/test?connect_timeout=2"
        markers = Path(tmp) / "markers"
        markers.mkdir()
        down = Server(kind, url, "", markers)
        down.start()
        try:
            for route in ("/after-raise", "/tx/sql-end"):
                reply = httpx.post(down.url + route, headers=_keyed(new_key()), json={})
                assert reply.status_code == 503, (route, reply.text)
                assert reply.headers["content-type"] == "application/problem+json"
                assert reply.json()["type"].endswith(":store-unavailable")
                assert reply.headers["retry-after"] == "1"
        finally:
            down.stop()
            down.engine.dispose()


def test_a_principal_given_as_an_int_id_scopes_the_key(tmp_path: Path) -> None:
    """principal=lambda scope: scope["user"].id (the README's example) returns an int for
    most user tables: that raised AttributeError in every keyed request (500, never ran)."""
    kind = KINDS[2]  # uvicorn over SQLite
    kind = ServerKind(kind.name, kind.database, {USER_ID: "42"}, kind.command)
    url = f"sqlite:///{tmp_path}/http.db"
    markers = tmp_path / "markers"
    markers.mkdir()
    server = Server(kind, url, "", markers)
    install(server.engine, server.tables)
    server.runs_table.create(server.engine)
    server.start()
    try:
        key = new_key()
        first = httpx.post(server.url + "/after-slow-not", headers=_keyed(key), json={})
        retry = httpx.post(server.url + "/after-slow-not", headers=_keyed(key), json={})
        assert (first.status_code, retry.status_code) == (201, 201)
        assert retry.headers["idempotent-replayed"] == "true"
        assert server.runs("after-slow-not") == 1
    finally:
        server.stop()
        server.engine.dispose()
