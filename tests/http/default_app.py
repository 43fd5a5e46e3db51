"""``IdempotencyMiddleware(app, engine)`` and nothing else, over the raw app of asgi_apps."""

from __future__ import annotations

from typing import Any

from consumerdedup.http import IdempotencyMiddleware
from tests.http.asgi_apps import Backend, make_raw


def make_app() -> Any:
    backend = Backend()  # CDD_HTTP_SCHEMA empty: the library's default table names
    return IdempotencyMiddleware(make_raw(backend), backend.engine)
