"""The Flask app the shared HTTP suite runs under waitress: the ASGI test app's routes, in WSGI.

``make_app()`` reads the same settings as asgi_apps.make_app (CDD_HTTP_DB, CDD_HTTP_SCHEMA,
CDD_HTTP_MARKERS, CDD_HTTP_LOG, and CDD_HTTP_STORE of tests/http/stores.py) and serves the same
routes with the
same effects (one http_runs row per endpoint run), so a test reads the same whichever
middleware answered. Only the blocking side exists here: a WSGI app runs in threads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, insert, make_url, select
from sqlalchemy.orm import Session

from consumerdedup import Outbox
from consumerdedup.http.wsgi import SESSION_KEY, WSGIIdempotencyMiddleware
from tests.http.asgi_apps import (
    BIG,
    POLICY,
    instrument_from_env,
    lease_expired_count,
    tables_for,
)
from tests.http.stores import store_from_env


def _engine(url: str) -> Engine:
    if make_url(url).get_backend_name() == "sqlite":
        return create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})
    return create_engine(url, pool_size=30, max_overflow=10)


def make_app() -> Any:
    from flask import Flask, Response, request

    instrument_from_env()
    if log_path := os.environ.get("CDD_HTTP_LOG"):
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        logging.getLogger("consumerdedup").addHandler(handler)
        logging.getLogger("consumerdedup").setLevel(logging.INFO)
    engine = _engine(os.environ["CDD_HTTP_DB"])
    tables, runs = tables_for(os.environ.get("CDD_HTTP_SCHEMA", ""))
    markers = Path(os.environ.get("CDD_HTTP_MARKERS", "."))
    outbox = Outbox(tables)
    app = Flask("consumerdedup-wsgi-tests")

    def record(route: str, principal: str | None, note: str) -> int:
        row = {"route": route, "principal": principal, "note": note}
        session = request.environ.get(SESSION_KEY)
        if route.startswith("tx/"):
            if not isinstance(session, Session):
                raise RuntimeError("no session")
            result = session.execute(insert(runs).values(row))
            outbox.add(session, "payments", note.encode())
            if route == "tx/commits":  # refused: the middleware commits
                session.commit()
            return int(result.inserted_primary_key[0])  # type: ignore[attr-defined]
        with engine.begin() as conn:
            return int(conn.execute(insert(runs).values(row)).inserted_primary_key[0])

    def answer(status: int, document: dict[str, Any], chunks: int = 1) -> Response:
        body = json.dumps(document).encode()
        size = max(1, len(body) // chunks + 1)
        parts = [body[i : i + size] for i in range(0, len(body), size)] or [b""]
        response = Response(iter(parts), status=status, content_type="application/json")
        response.headers["Set-Cookie"] = "session=secret"
        response.headers["X-Run"] = str(document.get("run", ""))
        return response

    @app.route("/health", methods=["GET", "POST"])
    def health() -> Response:
        return answer(200, {"ok": True})

    @app.get("/lease-expired-count")
    def lease_expired() -> Response:
        return answer(200, {"count": lease_expired_count()})

    def hold_key_row(key: str, seconds: float) -> None:
        """Lock the key's record (PostgreSQL) for ``seconds``: the lease's renewal, an UPDATE
        of that row, waits meanwhile, as it does on a store that stalls."""
        table = tables.idempotency_keys
        with engine.begin() as conn:
            conn.execute(select(table.c.key).where(table.c.key == key).with_for_update())
            time.sleep(seconds)

    @app.route("/<path:path>", methods=["GET", "POST", "PATCH", "PUT", "DELETE"])
    def endpoint(path: str) -> Response:
        body = request.get_data()
        principal = request.headers.get("X-User")
        note = body.decode("utf-8", "replace")[:200]
        route = path if request.method == "POST" else f"{request.method} /{path}"
        run = record(route, principal, note)
        if request.headers.get("X-Hang"):  # a header: not part of the fingerprint
            key = request.headers.get("Idempotency-Key") or "none"
            (markers / hashlib.sha256(key.encode()).hexdigest()).touch()
            threading.Event().wait()
        if "sleep" in request.args:
            time.sleep(float(request.args["sleep"]))
        if "lock" in request.args:
            hold_key_row(request.headers["Idempotency-Key"], float(request.args["lock"]))
        sha = hashlib.sha256(body).hexdigest()
        document = {"run": run, "sha256": sha, "bytes": len(body), "principal": principal}
        if path == "fail" or request.args.get("status") == "500":
            return answer(500, {"run": run, "error": "boom"})
        if path == "reject":
            return answer(400, {"run": run, "error": "bad amount"})
        if path in ("validated", "validated-stored") and b'"amount"' not in body:
            return answer(422, {"run": run, "error": "amount: field required"})
        if path in ("big", "tx/big"):
            chunks = (bytes([65 + i]) * (BIG // 4) for i in range(4))
            return Response(chunks, status=200)
        if path == "chunks":
            return answer(201, document, chunks=5)
        return answer(201, document)

    def principal_of(environ: Any) -> str | None:
        value = environ.get("HTTP_X_USER")
        return None if value is None else str(value)

    return WSGIIdempotencyMiddleware(
        app.wsgi_app,
        engine,
        store=store_from_env(asynchronous=False),
        policy=POLICY,
        principal=principal_of,
        tables=tables,
    )
