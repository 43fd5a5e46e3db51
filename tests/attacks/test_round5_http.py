"""Round-5 attacks on transactional HTTP idempotency (the pipelined PostgreSQL path of
22a7385), through real servers (uvicorn; waitress with Flask for the WSGI middleware) and
httpx.

``make_app`` is a raw ASGI app over one engine with ONE pooled connection (pool_size=1,
max_overflow=0), so a request after a failed one runs on the connection the failed one
left behind. ``CDD_R5_ISOLATION`` gives the engine an isolation level. Every POST /tx is
transactional with a required key; it writes one run (and an outbox event) in the
request's session, then does what its ``X-Attack`` header says (a header: not part of the
fingerprint, so a retry with the same key and body may attack differently):
  (none)          answers 201
  raise           raises after its write
  conn-commit     session.connection().commit(): ends the claim's transaction itself
  nested          writes again inside session.begin_nested(), answers 201
  raw-rollback    the DB-API connection's rollback(), then an ORM add left to the flush
  isolation       answers 201 with the transaction's isolation level
  terminate       its backend is terminated (pg_terminate_backend) before the commit
  deferred        a deferred unique constraint that fails only at COMMIT
  raw-commit-raise  the DB-API connection's own commit(), then raises (POST /txl: lease 1 s)
A server over SQLite (the plain path) takes the attacks that are not PostgreSQL's.
GET /state passes through and reports the pooled connection's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session, registry

from consumerdedup import Outbox
from consumerdedup.http import IdempotencyMiddleware, IdempotencyPolicy, RoutePolicy
from consumerdedup.http.asgi import SESSION_KEY
from tests.http import wsgi_server
from tests.http.asgi_apps import _answer, _read, tables_for
from tests.http.conftest import Server, ServerKind, new_key, serve, wait_for

LEASE = timedelta(seconds=1)
STREAMED = 512 * 1024  # four chunks: 2 MiB, over the default max_stored_body
POLICY = IdempotencyPolicy.of(
    {
        "/tx": RoutePolicy(required=True, transactional=True),
        "/txl": RoutePolicy(required=True, transactional=True, lease=LEASE),
    }
)


class Run:
    """An ORM-mapped run, for the attack whose write is left to the commit's flush."""

    route: str
    principal: str | None
    note: str


def _attacks(is_async: bool) -> tuple[Any, Any, Any, Any]:
    """The engine, the tables, ``attack(session, name) -> answer`` and (blocking engines)
    ``state() -> dict``, for the ASGI and the WSGI app alike."""
    url = os.environ["CDD_HTTP_DB"]
    schema = os.environ.get("CDD_HTTP_SCHEMA", "")
    tables, runs = tables_for(schema)
    mapper = registry()
    if not hasattr(Run, "__mapper__"):
        mapper.map_imperatively(Run, runs)
    options: dict[str, Any] = {"pool_size": 1, "max_overflow": 0}
    if level := os.environ.get("CDD_R5_ISOLATION"):
        options["isolation_level"] = level
    deferred = f"{schema}.r5_deferred" if schema else "r5_deferred"
    sqlite = make_url(url).get_backend_name() == "sqlite"
    if sqlite:
        options = {"connect_args": {"timeout": 30, "check_same_thread": False}}
    with create_engine(url).begin() as conn:
        if not sqlite:
            conn.exec_driver_sql(
                f"CREATE TABLE IF NOT EXISTS {deferred} (id int, "
                "CONSTRAINT r5_unique UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)"
            )
    side = create_engine(url, poolclass=None)  # the killer's own connection
    engine: Any = (
        create_async_engine(make_url(url).set(drivername="postgresql+psycopg"), **options)
        if is_async
        else create_engine(url, **options)
    )
    outbox = Outbox(tables)

    def attack_sync(session: Session, attack: str) -> str:
        row = {"route": "tx", "principal": None, "note": attack or "ok"}
        session.execute(runs.insert().values(row))
        outbox.add(session, "payments", (attack or "ok").encode())
        answer = ""
        if attack == "raise":
            raise RuntimeError("the endpoint failed after its write")
        if attack == "conn-commit":
            session.connection().commit()
        if attack == "raw-commit-raise":  # the DB-API connection's own commit()
            session.connection().connection.commit()
            raise RuntimeError("the endpoint failed after committing itself")
        if attack == "nested":
            with session.begin_nested():
                session.execute(runs.insert().values({**row, "note": "nested"}))
        if attack == "raw-rollback":
            session.connection().connection.rollback()  # the DB-API connection's
            run = Run()
            run.route, run.principal, run.note = "tx", None, "after-raw-rollback"
            session.add(run)  # flushed by the middleware's commit
        if attack == "isolation":
            answer = str(session.execute(text("SHOW transaction_isolation")).scalar_one())
        if attack == "terminate":
            pid = session.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with side.connect() as conn:
                conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        if attack == "hang":  # until the test SIGKILLs the server
            (Path(os.environ["CDD_HTTP_MARKERS"]) / "hanging").touch()
            time.sleep(30)
        if attack == "slow":  # long enough for the client to give up first
            time.sleep(0.5)
        if attack == "timeout":  # statement_timeout fires; the endpoint swallows it
            session.execute(text("SET LOCAL statement_timeout = '50ms'"))
            with contextlib.suppress(Exception):
                session.execute(text("SELECT pg_sleep(1)"))
        if attack in ("deferred", "stream-deferred"):
            session.execute(text(f"INSERT INTO {deferred} VALUES (1), (1)"))
        return answer

    def read() -> dict[str, Any]:
        with engine.connect() as conn:
            raw = conn.connection.driver_connection
            first = {"autocommit": raw.autocommit, "status": int(raw.info.transaction_status)}
            level = conn.execute(text("SHOW transaction_isolation")).scalar_one()
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
            return {**first, "isolation": level, "pid": pid}

    return engine, tables, attack_sync, read


def make_app() -> Any:
    is_async = os.environ.get("CDD_HTTP_ASYNC") == "1"
    engine, tables, attack_sync, read = _attacks(is_async)

    async def state() -> dict[str, Any]:
        if is_async:
            async with engine.connect() as conn:
                raw = (await conn.get_raw_connection()).driver_connection
                first = {"autocommit": raw.autocommit, "status": int(raw.info.transaction_status)}
                level = (await conn.execute(text("SHOW transaction_isolation"))).scalar_one()
                pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
                return {**first, "isolation": level, "pid": pid}
        return await asyncio.to_thread(read)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await _read(receive)
        if scope["path"] in ("/health", "/state"):
            await _answer(send, 200, await state() if scope["path"] == "/state" else {})
            return
        headers = dict(scope["headers"])
        attack = headers.get(b"x-attack", b"").decode()
        session = scope[SESSION_KEY]
        if isinstance(session, AsyncSession):
            answer = await session.run_sync(attack_sync, attack)
        else:
            answer = await asyncio.to_thread(attack_sync, session, attack)
        if attack.startswith("stream"):  # past max_stored_body (1 MiB): committed, then sent
            await send({"type": "http.response.start", "status": 201, "headers": []})
            for i in range(4):
                chunk = bytes([65 + i]) * STREAMED
                await send({"type": "http.response.body", "body": chunk, "more_body": i < 3})
            return
        await _answer(send, 201, {"attack": attack, "answer": answer})

    return IdempotencyMiddleware(app, engine, policy=POLICY, tables=tables)


def make_wsgi_app() -> Any:
    """The same attacks under Flask and WSGIIdempotencyMiddleware (waitress)."""
    from flask import Flask, jsonify, request

    from consumerdedup.http.wsgi import WSGIIdempotencyMiddleware

    engine, tables, attack_sync, read = _attacks(False)
    app = Flask("consumerdedup-attack-round5")

    @app.get("/health")
    def health() -> Any:
        return jsonify(ok=True)

    @app.get("/state")
    def state() -> Any:
        return jsonify(read())

    @app.post("/tx")
    @app.post("/txl")
    def attacked() -> Any:
        attack = request.headers.get("X-Attack", "")
        answer = attack_sync(request.environ[SESSION_KEY], attack)
        return jsonify(attack=attack, answer=answer), 201

    app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
        app.wsgi_app, engine, policy=POLICY, tables=tables
    )
    return app


def _waitress(port: int) -> list[str]:
    return wsgi_server.command("tests.attacks.test_round5_http:make_wsgi_app", port)


def _uvicorn(port: int) -> list[str]:
    from tests.http.conftest import uvicorn

    argv = uvicorn(port)
    argv[argv.index("tests.http.asgi_apps:make_app")] = "tests.attacks.test_round5_http:make_app"
    return argv


SQLITE = ServerKind("round5-sqlite-sync", "sqlite", {}, _uvicorn)
WAITRESS = ServerKind("round5-waitress-postgresql", "postgresql", {}, _waitress)
KINDS = [
    ServerKind("round5-postgresql-async", "postgresql", {"CDD_HTTP_ASYNC": "1"}, _uvicorn),
    ServerKind("round5-postgresql-sync", "postgresql", {}, _uvicorn),
]
SERIALIZABLE = [
    ServerKind(
        "round5-serializable-async",
        "postgresql",
        {"CDD_HTTP_ASYNC": "1", "CDD_R5_ISOLATION": "SERIALIZABLE"},
        _uvicorn,
    ),
    ServerKind(
        "round5-serializable-sync", "postgresql", {"CDD_R5_ISOLATION": "SERIALIZABLE"}, _uvicorn
    ),
]


@pytest.fixture(scope="module", params=[*KINDS, WAITRESS], ids=lambda k: k.name)
def attacked(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=[*KINDS, WAITRESS, SQLITE], ids=lambda k: k.name)
def any_database(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The PostgreSQL servers (uvicorn, waitress) and one over SQLite (the plain path)."""
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: k.name)
def attacked_asgi(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The uvicorn servers (the streaming attacks are written in ASGI)."""
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=KINDS[:1], ids=lambda k: k.name)
def attacked_async(request: pytest.FixtureRequest) -> Iterator[Server]:
    """The AsyncEngine's server only. Over a blocking engine with ONE pooled connection, 19
    twins wait for the pool in asyncio's few worker threads while the first request needs
    one of them to commit: all stall until pool_timeout (30 s; liveness, not a second
    effect: in the round-5 report)."""
    yield from serve(request, request.param)


@pytest.fixture(scope="module", params=SERIALIZABLE, ids=lambda k: k.name)
def serializable(request: pytest.FixtureRequest) -> Iterator[Server]:
    yield from serve(request, request.param)


def _post(server: Server, key: str, attack: str = "") -> httpx.Response:
    headers = {"Idempotency-Key": key, "X-Attack": attack}
    return httpx.post(server.url + "/tx", content=b"{}", headers=headers, timeout=15)


def _effects(server: Server) -> tuple[int, int]:
    """(runs committed, outbox events committed)."""
    outbox = server.qualified("outbox")
    return server.runs("tx"), server.count(f"SELECT count(*) FROM {outbox}")


def _clean_connection(server: Server, isolation: str = "read committed") -> None:
    """The one pooled connection is back as the pool lent it: not in autocommit, not inside
    a leftover transaction, at the engine's isolation level."""
    state = httpx.get(server.url + "/state", timeout=10).json()
    state.pop("pid")
    assert state == {"autocommit": False, "status": 0, "isolation": isolation}, state


def _retry_runs_once(server: Server, key: str, before: tuple[int, int]) -> None:
    """A retry of a request that committed nothing runs afresh, once; then it replays."""
    first = _post(server, key)
    assert first.status_code == 201, first.text
    again = _post(server, key)
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert _effects(server) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize("attack", ["raise", "terminate", "deferred", "timeout"])
def test_a_request_that_did_not_commit_leaves_nothing_and_a_clean_connection(
    attacked: Server, attack: str
) -> None:
    before = _effects(attacked)
    key = new_key()
    answer = _post(attacked, key, attack)
    assert not answer.is_success, answer.text  # no 2xx for work that did not commit
    assert _effects(attacked) == before
    _clean_connection(attacked)
    _retry_runs_once(attacked, key, before)
    _clean_connection(attacked)


def test_the_endpoint_committing_the_connection_itself_is_refused(attacked: Server) -> None:
    """session.connection().commit() would commit the write and a claim with no response:
    its retry would run again once the claim's lease ran out."""
    before = _effects(attacked)
    key = new_key()
    answer = _post(attacked, key, "conn-commit")
    assert answer.status_code >= 500, answer.text
    assert _effects(attacked) == before
    _clean_connection(attacked)
    _retry_runs_once(attacked, key, before)


def test_a_write_flushed_after_a_raw_rollback_never_commits_alone(attacked: Server) -> None:
    """The DB-API rollback() ended the claim's transaction; the ORM row left pending is
    flushed by the middleware's commit, on a connection in autocommit."""
    before = _effects(attacked)
    key = new_key()
    answer = _post(attacked, key, "raw-rollback")
    assert answer.status_code >= 500, answer.text
    assert _effects(attacked) == before
    assert attacked.runs("tx", "after-raw-rollback") == 0
    _clean_connection(attacked)
    _retry_runs_once(attacked, key, before)


def test_a_savepoint_in_the_endpoint_commits_with_the_response(attacked: Server) -> None:
    before = _effects(attacked)
    key = new_key()
    answer = _post(attacked, key, "nested")
    assert answer.status_code == 201, answer.text
    assert attacked.runs("tx", "nested") >= 1
    again = _post(attacked, key, "nested")
    assert again.headers.get("idempotent-replayed") == "true"
    assert _effects(attacked) == (before[0] + 2, before[1] + 1)
    _clean_connection(attacked)


def test_twenty_identical_requests_at_once_have_one_effect(attacked_async: Server) -> None:
    attacked = attacked_async
    before = _effects(attacked)
    key = new_key()

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=attacked.url, timeout=30) as client:
            sends = [
                client.post("/tx", content=b"{}", headers={"Idempotency-Key": key})
                for _ in range(20)
            ]
            return list(await asyncio.gather(*sends))

    answers = asyncio.run(burst())
    codes = sorted(a.status_code for a in answers)
    assert set(codes) <= {201, 409}, codes
    assert _effects(attacked) == (before[0] + 1, before[1] + 1)
    fresh = [a for a in answers if a.status_code == 201 and "idempotent-replayed" not in a.headers]
    assert len(fresh) == 1
    other = httpx.post(
        attacked.url + "/tx", content=b'{"other": 1}', headers={"Idempotency-Key": key}, timeout=10
    )
    assert other.status_code == 422, other.text
    _clean_connection(attacked)


def test_the_engines_isolation_level_holds_in_the_endpoint_and_after(serializable: Server) -> None:
    """An engine at SERIALIZABLE: the endpoint's transaction must run at it (a payment that
    checks a balance relies on it), and the pooled connection must come back at it."""
    answer = _post(serializable, new_key(), "isolation")
    assert answer.status_code == 201, answer.text
    assert json.loads(answer.content)["answer"] == "serializable"
    _clean_connection(serializable, "serializable")


@pytest.mark.parametrize("attack", ["raise", "conn-commit"])
def test_on_every_database_a_failed_request_commits_nothing_and_its_retry_runs_once(
    any_database: Server, attack: str
) -> None:
    before = _effects(any_database)
    key = new_key()
    answer = _post(any_database, key, attack)
    assert answer.status_code >= 500, answer.text
    assert _effects(any_database) == before
    _retry_runs_once(any_database, key, before)


def test_on_every_database_a_savepoint_commits_with_the_response(any_database: Server) -> None:
    before = _effects(any_database)
    key = new_key()
    assert _post(any_database, key, "nested").status_code == 201
    assert _post(any_database, key, "nested").headers.get("idempotent-replayed") == "true"
    assert _effects(any_database) == (before[0] + 2, before[1] + 1)


def test_a_claim_the_endpoint_committed_itself_is_never_run_again(any_database: Server) -> None:
    """The DB-API connection's own commit() (not refusable: no SQLAlchemy event sees it)
    committed the write and the claim, with no response; then the endpoint failed. Once the
    claim's lease ran out, the retry took it over and ran the endpoint a second time."""
    server = any_database
    before = _effects(server)
    key = new_key()
    headers = {"Idempotency-Key": key, "X-Attack": "raw-commit-raise"}
    first = httpx.post(server.url + "/txl", content=b"{}", headers=headers, timeout=15)
    assert first.status_code >= 500
    time.sleep(LEASE.total_seconds() + 0.2)  # the lease must run out: that is the attack
    retry = httpx.post(
        server.url + "/txl", content=b"{}", headers={"Idempotency-Key": key}, timeout=15
    )
    assert server.runs("tx") - before[0] <= 1, "the endpoint ran twice"
    assert retry.status_code == 409, retry.text
    assert retry.json()["type"].endswith(":response-not-stored")


def test_a_pooled_connection_killed_while_idle_is_replaced_not_leaked(attacked: Server) -> None:
    """A PostgreSQL restart, or pg_terminate_backend on the idle pooled connection: the next
    request's pipelined claim meets a dead connection. It must fail cleanly, and the one
    pooled connection must be replaced, not kept checked out (every later request would
    wait on an empty pool)."""
    pid = httpx.get(attacked.url + "/state", timeout=10).json()["pid"]
    with attacked.engine.connect() as conn:
        conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    before = _effects(attacked)
    key = new_key()
    first = _post(attacked, key)
    assert first.status_code in (201, 503), first.text  # 503 store-unavailable: nothing ran
    if first.status_code == 503:
        assert _effects(attacked) == before
        _retry_runs_once(attacked, key, before)
    _clean_connection(attacked)


def test_a_streamed_response_commits_once_and_is_never_rerun(attacked_asgi: Server) -> None:
    server = attacked_asgi
    before = _effects(server)
    key = new_key()
    answer = _post(server, key, "stream")
    assert answer.status_code == 201 and len(answer.content) == 4 * STREAMED
    retry = _post(server, key, "stream")
    assert retry.status_code == 409 and retry.json()["type"].endswith(":response-not-stored")
    assert _effects(server) == (before[0] + 1, before[1] + 1)
    _clean_connection(server)


def test_a_streamed_response_whose_commit_fails_is_not_a_success(attacked_asgi: Server) -> None:
    """The commit happens when the response outgrows max_stored_body; a deferred constraint
    fails it: the client must not get the 201, and nothing may commit."""
    server = attacked_asgi
    before = _effects(server)
    key = new_key()
    answer = _post(server, key, "stream-deferred")
    assert not answer.is_success, answer.status_code
    assert _effects(server) == before
    _clean_connection(server)
    _retry_runs_once(server, key, before)


def test_a_client_that_gives_up_mid_request_is_charged_once(attacked: Server) -> None:
    """The client times out while the endpoint runs: the endpoint completes and commits, and
    the retry (polled while the first is still in flight) gets the stored response."""
    before = _effects(attacked)
    key = new_key()
    headers = {"Idempotency-Key": key, "X-Attack": "slow"}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(attacked.url + "/tx", content=b"{}", headers=headers, timeout=0.1)

    def replayed() -> httpx.Response | None:
        retry = _post(attacked, key, "slow")
        return retry if retry.status_code != 409 else None

    retry = wait_for(replayed, 10, "the first request to commit")
    assert retry.status_code == 201 and retry.headers["idempotent-replayed"] == "true"
    assert _effects(attacked) == (before[0] + 1, before[1] + 1)
    _clean_connection(attacked)


def test_a_server_killed_mid_request_leaves_nothing_and_the_retry_runs_once(
    attacked: Server,
) -> None:
    """SIGKILL between the pipelined claim and its COMMIT: no effect and no key survive, so
    the retry (on a restarted server) runs afresh, with no lease to wait out."""
    before = _effects(attacked)
    key = new_key()
    marker = attacked.markers / "hanging"
    marker.unlink(missing_ok=True)
    headers = {"Idempotency-Key": key, "X-Attack": "hang"}

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(attacked.url + "/tx", content=b"{}", headers=headers, timeout=20)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        wait_for(marker.exists, 10, "the endpoint to write and hang")
    finally:
        attacked.kill()
        sender.join(20)
        attacked.start()
    assert _effects(attacked) == before
    _retry_runs_once(attacked, key, before)
    _clean_connection(attacked)
