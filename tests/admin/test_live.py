"""The Failures page's live refresh as served (the browser side is in test_browser.py): the
script is a file of the package under the page's own Content-Security-Policy (no inline
script), ``?live=0`` leaves it out, a bad ``?live`` is a 400 saying what is expected."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from consumerdedup.admin import admin_app
from tests.admin.server import postgres, served
from tests.conftest import Database


@pytest.fixture(scope="module")
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        yield found


def test_the_script_is_served_from_the_package_and_can_be_turned_off(db: Database) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base, httpx.Client(base_url=base, timeout=10) as client:
        page = client.get("/failures")
        assert '<script src="/admin/static/live.js" defer></script>' in page.text
        assert 'data-live="10"' in page.text
        policy = page.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "unsafe-inline" not in policy
        script = client.get("/static/live.js")
        assert script.status_code == 200 and "javascript" in script.headers["content-type"]
        assert "replaceChildren" in script.text
        off = client.get("/failures", params={"live": "0"})
        assert "live.js" not in off.text and "data-live-status" not in off.text
        assert 'data-live="2"' in client.get("/failures", params={"live": "2"}).text
        for bad in ("1", "3601", "x", "-5"):
            refused = client.get("/failures", params={"live": bad})
            assert refused.status_code == 400, bad
            assert "expected seconds from 2 to 3600, or 0" in refused.text
