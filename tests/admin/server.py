"""The admin app served for real: uvicorn in a thread of the test process on a free
loopback port (so a test reads the audit entries the app wrote), and a PostgreSQL
schema of the module's own."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from starlette.applications import Starlette
from starlette.routing import Mount

from consumerdedup.admin import AuditEntry
from consumerdedup.schema import Tables, install
from tests.conftest import Database
from tests.support.kafka_service import free_port


@contextmanager
def postgres(url: str) -> Iterator[Database]:
    """A schema of its own with the library's tables, dropped at the end."""
    schema = f"adm_{uuid.uuid4().hex[:12]}"
    engine = create_engine(url, pool_size=10, max_overflow=10)
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    install(engine, tables)
    async_url = make_url(url).set(drivername="postgresql+psycopg").render_as_string(False)
    try:
        yield Database("postgresql", url, async_url, schema, engine, tables)
    finally:
        with engine.begin() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()


class Audits(list[AuditEntry]):
    """The audit entries an app wrote (its ``audit`` callable)."""

    def __call__(self, entry: AuditEntry) -> None:
        self.append(entry)


@contextmanager
def served(app: Any, *, mount: str = "/admin") -> Iterator[str]:
    """``app`` mounted at ``mount`` in a parent Starlette app, as a user mounts it, served
    by uvicorn on a free loopback port; yields the admin pages' base URL."""
    parent = Starlette(routes=[Mount(mount, app=app)])
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(parent, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the admin server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}{mount}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
