"""The WSGI middleware in front of a Django app, under a real waitress server, with httpx.

The README claims Flask *and* Django; the shared suite runs Flask. Here a tiny Django
project (settings configured in code, no settings module, one POST view and one that sets
a cookie) is wrapped with WSGIIdempotencyMiddleware around Django's own WSGIHandler: the
view runs once per key, the retry gets the same status, headers and body with
Idempotent-Replayed, another body on the key is 422 without running the view, Django's
Set-Cookie is never replayed, and a Django 500 is not stored (the retry runs again).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine

from tests.http.conftest import runs_in, serve_wsgi
from tests.http.wsgi_server import WsgiServer

pytest.importorskip("django")


def make_app() -> Any:
    """Django configured in code, wrapped in the middleware (read by tests.http.wsgi_server)."""
    import django
    from django.conf import settings
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    from consumerdedup.http import IdempotencyPolicy, RoutePolicy, WSGIIdempotencyMiddleware

    runs = Path(os.environ["CDD_DJANGO_RUNS"])

    def ran(name: str) -> int:
        with runs.open("a") as f:
            f.write(name + "\n")
        return runs.read_text().splitlines().count(name)

    @csrf_exempt
    def pay(request: HttpRequest) -> HttpResponse:
        body = json.loads(request.body)
        count = ran("pay")
        response = JsonResponse({"paid": body["amount"], "run": count}, status=201)
        response["X-Payment"] = f"p-{count}"
        response.set_cookie("session", f"secret-{count}")
        return response

    @csrf_exempt
    def boom(request: HttpRequest) -> HttpResponse:
        ran("boom")
        return HttpResponse("failed", status=500)

    settings.configure(
        DEBUG=False,
        SECRET_KEY="test-only",
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__ + "_urls",
        MIDDLEWARE=["django.middleware.common.CommonMiddleware"],
        INSTALLED_APPS=[],
        DATABASES={},
    )
    import sys
    import types

    urls = types.ModuleType(__name__ + "_urls")
    urls.urlpatterns = [path("pay", pay), path("boom", boom)]  # type: ignore[attr-defined]
    sys.modules[urls.__name__] = urls
    django.setup()
    from django.core.wsgi import get_wsgi_application

    engine = create_engine(os.environ["CDD_DJANGO_DB"])
    policy = IdempotencyPolicy.of({"/*": RoutePolicy(required=True)})
    return WSGIIdempotencyMiddleware(get_wsgi_application(), engine, policy=policy)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WsgiServer, Path]]:
    yield from serve_wsgi(
        tmp_path_factory.mktemp("django"), "tests.http.test_django:make_app", "CDD_DJANGO"
    )


def test_a_django_view_runs_once_and_its_retry_is_replayed(
    server: tuple[WsgiServer, Path],
) -> None:
    running, runs = server
    key = {"Idempotency-Key": uuid.uuid4().hex}
    before = runs_in(runs, "pay")
    with httpx.Client(base_url=running.url, timeout=10) as client:
        first = client.post("/pay", json={"amount": 5}, headers=key)
        again = client.post("/pay", json={"amount": 5}, headers=key)
        other = client.post("/pay", json={"amount": 6}, headers=key)
        missing = client.post("/pay", json={"amount": 5})
    assert first.status_code == 201, first.text
    assert "idempotent-replayed" not in first.headers
    assert first.cookies.get("session") is not None  # the first response keeps its cookie
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert again.headers["x-payment"] == first.headers["x-payment"]
    assert again.headers["content-type"] == "application/json"
    assert "set-cookie" not in again.headers  # a session is never handed to whoever retries
    assert other.status_code == 422
    assert other.headers["content-type"] == "application/problem+json"
    assert missing.status_code == 400
    assert runs_in(runs, "pay") == before + 1


def test_a_django_500_is_not_stored_and_the_retry_runs(server: tuple[WsgiServer, Path]) -> None:
    running, runs = server
    key = {"Idempotency-Key": uuid.uuid4().hex}
    before = runs_in(runs, "boom")
    with httpx.Client(base_url=running.url, timeout=10) as client:
        answers = [client.post("/boom", content=b"x", headers=key).status_code for _ in range(2)]
    assert answers == [500, 500]
    assert runs_in(runs, "boom") == before + 2
