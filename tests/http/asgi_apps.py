"""The apps the shared HTTP suite runs under uvicorn: a raw ASGI app and FastAPI over it.

``make_app()`` reads its settings from the environment (the server is a
subprocess): CDD_HTTP_DB (a sync URL), CDD_HTTP_ASYNC ("1": an AsyncEngine),
CDD_HTTP_SCHEMA (PostgreSQL schema, or empty), CDD_HTTP_FRAMEWORK (raw or
fastapi), CDD_HTTP_MARKERS (a directory where a hanging request drops a file).

Every endpoint run inserts one row into http_runs (route, principal, note),
which is what the tests count. Routes (POST unless said; principal = X-User):
  /payments      key required; ?sleep=S before answering; X-Hang: marker file, then hang
  /tx/payments   the same, transactional (row written in the request's Session, plus an
                 outbox event); ?status=500 answers 500 after writing (rolled back)
  /fail          answers 500              /reject   answers 400 (stored)
  /big           a 2 MiB body in 4 chunks (over max_stored_body: not stored)
  /chunks        a body in 5 chunks, echoing the request body's sha256 and size
  /expiring      expiry 1 s               /lease    lease 1 s (for SIGKILL)
  /wait          waits up to 5 s for an in-flight twin; /tx/wait the same, transactional
  /tx/commits    a transactional endpoint that commits the session itself (refused)
  /tx/big        /big, transactional (its write commits when the response outgrows the limit)
  /small         max_request_body 1024
CDD_HTTP_LOG: a file for the consumerdedup log lines (INFO).
  /patchable     POST and PATCH deduplicated; PATCH /payments passes through
  GET /payments  passes through
  /validated     422 unless the JSON body has "amount" (422 not stored: unstored_statuses);
                 /validated-stored the same with the default policy (the 422 is stored)
  /lease?block=S blocks the event loop S seconds (time.sleep), as a sync call in an
                 async endpoint does: the lease cannot be renewed meanwhile
CDD_HTTP_METRICS=1: OpenTelemetry metrics into an in-memory reader (telemetry.instrument);
  GET /lease-expired-count answers consumerdedup.http.lease_expired's sum.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from sqlalchemy import (
    Column,
    Engine,
    Integer,
    String,
    Table,
    Text,
    create_engine,
    func,
    insert,
    make_url,
    select,
)
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from consumerdedup import Outbox, Tables
from consumerdedup.http import IdempotencyMiddleware, IdempotencyPolicy, RoutePolicy
from consumerdedup.http.asgi import SESSION_KEY
from tests.http.stores import store_from_env

REQUIRED = RoutePolicy(required=True)
POLICY = IdempotencyPolicy.of(
    {
        "/payments": REQUIRED,
        "/tx/payments": RoutePolicy(required=True, transactional=True),
        "/expiring": RoutePolicy(required=True, expiry=timedelta(seconds=1)),
        "/lease": RoutePolicy(required=True, lease=timedelta(seconds=1)),
        "/wait": RoutePolicy(required=True, wait=timedelta(seconds=5)),
        "/tx/wait": RoutePolicy(required=True, transactional=True, wait=timedelta(seconds=5)),
        "/tx/commits": RoutePolicy(required=True, transactional=True),
        "/tx/big": RoutePolicy(required=True, transactional=True),
        "/small": RoutePolicy(required=True, max_request_body=1024),
        "/patchable": RoutePolicy(methods=frozenset({"POST", "PATCH"})),
        "/validated": RoutePolicy(required=True, unstored_statuses=frozenset({422})),
        "/validated-stored": REQUIRED,
    }
)
BIG = 2 * 1024 * 1024


def tables_for(schema: str) -> tuple[Tables, Table]:
    prefix = f"{schema}." if schema else ""
    tables = Tables.define(f"{prefix}processed_events", f"{prefix}outbox")
    runs = Table(
        "http_runs",
        tables.metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("route", String(64), nullable=False),
        Column("principal", String(64), nullable=True),
        Column("note", Text, nullable=True),
        schema=schema or None,
    )
    return tables, runs


def count_runs(engine: Engine, runs: Table, route: str, note: str | None = None) -> int:
    query = select(func.count()).select_from(runs).where(runs.c.route == route)
    if note is not None:
        query = query.where(runs.c.note == note)
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


class Backend:
    def __init__(self) -> None:
        url = os.environ["CDD_HTTP_DB"]
        self.schema = os.environ.get("CDD_HTTP_SCHEMA", "")
        self.markers = Path(os.environ.get("CDD_HTTP_MARKERS", "."))
        self.tables, self.runs = tables_for(self.schema)
        self.engine: Engine | AsyncEngine
        if os.environ.get("CDD_HTTP_ASYNC") == "1":
            parsed = make_url(url)
            backend = parsed.get_backend_name()
            driver = "sqlite+aiosqlite" if backend == "sqlite" else None
            asyncio_driver = "mysql+aiomysql" if backend == "mysql" else "postgresql+psycopg"
            async_url = parsed.set(drivername=driver or asyncio_driver)
            self.engine = (
                create_async_engine(async_url, pool_size=30, max_overflow=10)
                if (driver is None)
                else create_async_engine(async_url)
            )
        else:
            options: dict[str, Any] = {"pool_size": 30, "max_overflow": 10}
            if make_url(url).get_backend_name() == "sqlite":
                options = {"connect_args": {"timeout": 30, "check_same_thread": False}}
            self.engine = create_engine(url, **options)
        self.outbox = Outbox(self.tables)

    async def record(self, route: str, principal: str | None, note: str) -> int:
        row = {"route": route, "principal": principal, "note": note}
        if isinstance(self.engine, AsyncEngine):
            async with self.engine.begin() as conn:
                return int(
                    (await conn.execute(insert(self.runs).values(row))).inserted_primary_key[0]
                )
        engine = self.engine

        def write() -> int:
            with engine.begin() as conn:
                return int(conn.execute(insert(self.runs).values(row)).inserted_primary_key[0])

        return await asyncio.to_thread(write)

    async def record_in(
        self, session: Session | AsyncSession, route: str, principal: str | None, note: str
    ) -> int:
        row = {"route": route, "principal": principal, "note": note}
        if isinstance(session, AsyncSession):
            result = await session.execute(insert(self.runs).values(row))
            await session.run_sync(lambda s: self.outbox.add(s, "payments", note.encode()))
            return int(result.inserted_primary_key[0])  # type: ignore[attr-defined]

        def write() -> int:
            result = session.execute(insert(self.runs).values(row))
            self.outbox.add(session, "payments", note.encode())
            return int(result.inserted_primary_key[0])  # type: ignore[attr-defined]

        return await asyncio.to_thread(write)


async def _commit_async(session: AsyncSession) -> None:
    await session.commit()


async def _read(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for n, v in scope["headers"]:
        if n.lower() == name:
            return str(v.decode("latin-1"))
    return None


async def _answer(send: Any, status: int, document: dict[str, Any], chunks: int = 1) -> None:
    body = json.dumps(document).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"set-cookie", b"session=secret"),
        (b"x-run", str(document.get("run", "")).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    size = max(1, len(body) // chunks + 1)
    parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


def make_raw(backend: Backend) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = await _read(receive)
        path = scope["path"]
        query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
        principal = _header(scope, b"x-user")
        note = body.decode("utf-8", "replace")[:200]
        route = path.strip("/") if scope["method"] == "POST" else f"{scope['method']} {path}"
        if path == "/health":
            await _answer(send, 200, {"ok": True})
            return
        if path == "/lease-expired-count":  # GET: passes through the middleware
            await _answer(send, 200, {"count": lease_expired_count()})
            return
        session = scope.get(SESSION_KEY)
        if path.startswith("/tx/"):
            if session is None:
                await _answer(send, 500, {"error": "no session"})
                return
            run = await backend.record_in(session, route, principal, note)
            if path == "/tx/commits":  # refused: the middleware commits
                await (
                    _commit_async(session)
                    if isinstance(session, AsyncSession)
                    else asyncio.to_thread(session.commit)
                )
        else:
            run = await backend.record(route, principal, note)
        if _header(scope, b"x-hang"):  # a header: not part of the fingerprint
            key = _header(scope, b"idempotency-key") or "none"
            (backend.markers / hashlib.sha256(key.encode()).hexdigest()).touch()
            await asyncio.Event().wait()
        if "sleep" in query:
            await asyncio.sleep(float(query["sleep"]))
        if "block" in query:
            time.sleep(float(query["block"]))  # blocks the event loop, on purpose
        sha = hashlib.sha256(body).hexdigest()
        document = {"run": run, "sha256": sha, "bytes": len(body), "principal": principal}
        if path == "/fail" or query.get("status") == "500":
            await _answer(send, 500, {"run": run, "error": "boom"})
        elif path == "/reject":
            await _answer(send, 400, {"run": run, "error": "bad amount"})
        elif path in ("/validated", "/validated-stored") and b'"amount"' not in body:
            await _answer(send, 422, {"run": run, "error": "amount: field required"})
        elif path in ("/big", "/tx/big"):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for i in range(4):
                chunk = bytes([65 + i]) * (BIG // 4)
                await send({"type": "http.response.body", "body": chunk, "more_body": i < 3})
        elif path == "/chunks":
            await _answer(send, 201, document, chunks=5)
        else:
            await _answer(send, 201, document)

    return app


def make_fastapi(backend: Backend, raw: Any) -> Any:
    from consumerdedup.http.fastapi import Idempotent, TransactionalSession

    api = FastAPI()

    @api.post("/payments", dependencies=[Idempotent(required=True)], status_code=201)
    async def pay(request: Request) -> Response:
        return await _delegate(raw, request)

    @api.post("/tx/payments", status_code=201)
    async def pay_tx(
        request: Request,
        session: Any = TransactionalSession(required=True),  # noqa: B008
    ) -> Response:
        return await _delegate(raw, request)

    api.mount("/", raw)
    return api


async def _delegate(raw: Any, request: Request) -> Response:
    """Run the raw app's endpoint under FastAPI's routing (its writes are the same)."""
    body = await request.body()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await raw(request.scope, receive, send)
    start = sent[0]
    content = b"".join(m.get("body", b"") for m in sent[1:])
    headers = {n.decode(): v.decode() for n, v in start["headers"]}
    return Response(content, status_code=start["status"], headers=headers)


_METRICS: list[Any] = []  # the in-memory reader, when CDD_HTTP_METRICS=1


def instrument_from_env() -> None:
    """CDD_HTTP_METRICS=1: consumerdedup's OpenTelemetry metrics into an in-memory reader."""
    if os.environ.get("CDD_HTTP_METRICS") != "1":
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumerdedup.telemetry import instrument

    reader = InMemoryMetricReader()
    instrument(meter_provider=MeterProvider(metric_readers=[reader]))
    _METRICS.append(reader)


def lease_expired_count() -> int:
    """The sum of consumerdedup.http.lease_expired so far (0 without metrics)."""
    if not _METRICS:
        return 0
    data = _METRICS[0].get_metrics_data()
    total = 0
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "consumerdedup.http.lease_expired":
                    total += sum(int(point.value) for point in metric.data.data_points)
    return total


def make_app() -> Any:
    instrument_from_env()
    if log_path := os.environ.get("CDD_HTTP_LOG"):
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        logging.getLogger("consumerdedup").addHandler(handler)
        logging.getLogger("consumerdedup").setLevel(logging.INFO)
    backend = Backend()
    raw = make_raw(backend)
    inner = (
        raw if os.environ.get("CDD_HTTP_FRAMEWORK", "raw") == "raw" else make_fastapi(backend, raw)
    )
    routes = getattr(inner, "routes", ())

    def principal(scope: Any) -> str | None:
        return _header(scope, b"x-user")

    return IdempotencyMiddleware(
        inner,
        backend.engine,
        store=store_from_env(isinstance(backend.engine, AsyncEngine)),
        policy=POLICY,
        routes=routes,
        principal=principal,
        tables=backend.tables,
    )
