"""Deny by default, against the real server and PostgreSQL: no app without an
authorisation decision; read-only refuses every POST; a missing or wrong token is
refused; a POST without the CSRF token, or from another site, is refused; a viewer never
acts; no password of the database URL and no raw markup of a reason is rendered."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, insert
from sqlalchemy.engine import make_url
from starlette.requests import Request

from consumerdedup.admin import Grant, Role, admin_app
from consumerdedup.errors import ConfigurationError
from consumerdedup.http.sql_store import SqlStore
from consumerdedup.http.store import Claimed
from consumerdedup.http.stored import StoredResponse
from tests.admin.server import Audits, postgres, served
from tests.conftest import Database

TOKEN = "a-long-enough-test-token-0123456789"
CSRF = "consumerdedup_admin_csrf"


@pytest.fixture(scope="module")
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        reason = "ValueError: <script>alert(1)</script>"
        rows = [failed("billing", f"b-{n}", reason) for n in range(3)]
        with found.engine.begin() as conn:
            conn.execute(insert(found.tables.processed_events), rows)
        yield found


def failed(consumer: str, message_id: str, reason: str) -> dict[str, Any]:
    return {
        "consumer": consumer,
        "message_id": message_id,
        "processed_at": datetime.now(UTC),
        "payload_hash": "0" * 64,
        "outcome": "failed",
        "error": reason,
    }


def still_failed(db: Database, consumer: str = "billing") -> int:
    pe = db.name("processed_events")
    where = f"outcome = 'failed' AND consumer = '{consumer}'"
    return int(db.scalar(f"SELECT count(*) FROM {pe} WHERE {where}") or 0)


def forget_all(
    client: httpx.Client,
    base: str,
    csrf: str | None,
    consumer: str = "billing",
    expected: str | None = "3",
    **extra: Any,
) -> httpx.Response:
    """``forget`` on every record of ``consumer``, confirmed for ``expected`` records."""
    form = {"action": "forget", "scope": "matching", "consumer": consumer, "confirm": "yes"}
    form["why"] = "test"
    if expected is not None:
        form["expected"] = expected
    if csrf is not None:
        form["csrf"] = csrf
    return client.post(f"{base}/failures/apply", data=form, **extra)


def test_an_app_without_an_authorisation_decision_is_refused(db: Database) -> None:
    with pytest.raises(ConfigurationError, match="authorize"):
        admin_app(db.engine, tables=db.tables)
    with pytest.raises(ConfigurationError, match="allow_loopback"):
        admin_app(db.engine, tables=db.tables, allow_loopback="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="token"):
        admin_app(db.engine, tables=db.tables, token="short")


def test_read_only_refuses_the_post_even_with_its_csrf_token(db: Database) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base, httpx.Client() as client:
        listing = client.get(f"{base}/failures")
        assert listing.status_code == 200 and 'name="action"' not in listing.text
        csrf = client.cookies[CSRF]
        refused = forget_all(client, base, csrf)
        assert refused.status_code == 403 and "read-only" in refused.text
    assert still_failed(db) == 3


def test_a_post_without_the_csrf_token_or_from_another_site_is_refused(db: Database) -> None:
    audits = Audits()
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True, actions=True, audit=audits)
    with served(app) as base, httpx.Client() as client:
        assert forget_all(client, base, None).status_code == 403  # no cookie, no field
        client.get(f"{base}/failures")
        csrf = client.cookies[CSRF]
        assert forget_all(client, base, None).status_code == 403  # cookie, no field
        assert forget_all(client, base, "x" * len(csrf)).status_code == 403  # wrong field
        evil = {"origin": "http://evil.example"}
        assert forget_all(client, base, csrf, headers=evil).status_code == 403
        with httpx.Client() as other:  # a field copied without the cookie
            assert forget_all(other, base, csrf).status_code == 403
        assert client.get(f"{base}/failures/apply").status_code == 405  # never a GET
        assert still_failed(db) == 3 and audits == []
        preview = client.post(
            f"{base}/failures/preview",
            data={"action": "forget", "scope": "matching", "consumer": "billing", "csrf": csrf},
        )
        assert preview.status_code == 200 and 'class="count">3<' in preview.text
        assert still_failed(db) == 3  # a preview changes nothing


def test_a_missing_or_wrong_token_is_refused(db: Database) -> None:
    app = admin_app(db.engine, tables=db.tables, token=TOKEN)
    with served(app) as base, httpx.Client() as client:
        assert client.get(f"{base}/overview").status_code == 401
        wrong = {"authorization": "Bearer " + TOKEN[:-1] + "x"}
        assert client.get(f"{base}/failures.json", headers=wrong).status_code == 401
        right = {"authorization": "Bearer " + TOKEN}
        found = client.get(f"{base}/failures.json", headers=right)
        assert found.status_code == 200 and len(found.json()["records"]) == 3
        query = {"consumer": "billing", "id": "b-0"}
        one = client.get(f"{base}/failures/record.json", params=query, headers=right).json()
        assert one["record"]["payload_hash"] == "0" * 64  # all we stored, on its page
        login = client.get(f"{base}/login")
        csrf = client.cookies[CSRF]
        refused = client.post(f"{base}/login", data={"token": "nope" * 5, "csrf": csrf})
        assert refused.status_code == 401 and TOKEN not in refused.text
        assert login.status_code == 200
        ok = client.post(f"{base}/login", data={"token": TOKEN, "csrf": csrf})
        assert ok.status_code == 303
        assert TOKEN not in str(client.cookies.jar)  # the cookie is a digest, not the token
        assert client.get(f"{base}/failures").status_code == 200


def test_a_viewer_never_acts_and_refused_visitors_see_nothing(db: Database) -> None:
    audits = Audits()
    with db.engine.begin() as conn:  # a consumer of this test's own: the others keep theirs
        rows = [failed("ledger", f"l-{n}", "KeyError: 'sku'") for n in range(3)]
        conn.execute(insert(db.tables.processed_events), rows)

    def authorize(request: Request) -> Role | Grant | None:
        role = request.headers.get("x-role")
        if role == "operator":
            return Grant(Role.OPERATOR, "alice")
        return Role.VIEWER if role == "viewer" else None

    app = admin_app(db.engine, tables=db.tables, authorize=authorize, actions=True, audit=audits)
    with served(app) as base, httpx.Client() as client:
        assert client.get(f"{base}/overview").status_code == 403
        viewer = {"x-role": "viewer"}
        page = client.get(f"{base}/failures", headers=viewer)
        assert page.status_code == 200 and 'name="action"' not in page.text
        refused = forget_all(client, base, client.cookies[CSRF], "ledger", headers=viewer)
        assert refused.status_code == 403 and still_failed(db, "ledger") == 3
        operator = {"x-role": "operator"}
        assert 'name="action"' in client.get(f"{base}/failures", headers=operator).text
        done = forget_all(client, base, client.cookies[CSRF], "ledger", headers=operator)
        assert done.status_code == 200 and 'class="count">3<' in done.text
    assert still_failed(db, "ledger") == 0 and still_failed(db) == 3
    [entry] = audits
    said = (entry.who, entry.role, entry.action, entry.count, entry.reason)
    assert said == ("alice", "operator", "failed.forget", 3, "test")
    assert sorted(entry.ids) == ["l-0", "l-1", "l-2"]


async def test_allow_loopback_lets_no_other_client_in(db: Database) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    for client, status in ((("10.1.2.3", 50000), 403), (("127.0.0.1", 50000), 200)):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://admin") as remote:
            assert (await remote.get("/failures")).status_code == status


def test_no_password_and_no_raw_markup_is_rendered(postgres_url: str, db: Database) -> None:
    url = make_url(postgres_url).set(password="hunter2-SECRET")  # trust auth ignores it
    engine = create_engine(url)
    app = admin_app(engine, tables=db.tables, allow_loopback=True)
    try:
        with served(app) as base, httpx.Client() as client:
            for path in ("/overview", "/overview.json", "/failures", "/failures.json"):
                shown = client.get(base + path)
                assert shown.status_code == 200, path
                assert "hunter2" not in shown.text
                if not path.endswith(".json"):  # HTML escapes the reason; JSON is data
                    assert "<script>alert" not in shown.text
                    assert "&lt;script&gt;alert" in shown.text
    finally:
        engine.dispose()


def test_a_stored_credential_header_and_body_are_not_shown(db: Database) -> None:
    store = SqlStore(db.engine, db.tables)
    claimed = store.claim("POST /login", "k-1", "fp", timedelta(minutes=1))
    assert isinstance(claimed, Claimed)
    headers = (("x-session-token", "tok-VALUE-1"), ("content-type", "application/json"))
    response = StoredResponse(200, headers, b'{"card": "4111-BODY"}')
    assert store.complete("POST /login", "k-1", claimed.token, response, timedelta(hours=1))
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base, httpx.Client() as client:
        query = {"scope": "POST /login", "key": "k-1"}
        for path in ("/keys/record", "/keys/record.json"):
            shown = client.get(base + path, params=query)
            assert shown.status_code == 200 and "application/json" in shown.text
            assert "tok-VALUE" not in shown.text and "4111-BODY" not in shown.text


def test_a_whole_search_grown_since_its_preview_is_not_acted_on(db: Database) -> None:
    def add(*ids: str) -> None:
        with db.engine.begin() as conn:
            rows = [failed("late", i, "KeyError: 'sku'") for i in ids]
            conn.execute(insert(db.tables.processed_events), rows)

    add("l-0", "l-1", "l-2")
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True, actions=True)
    with served(app) as base, httpx.Client() as client:
        client.get(f"{base}/failures")
        csrf = client.cookies[CSRF]
        add("l-3")  # failed after the operator's preview counted three
        grown = forget_all(client, base, csrf, "late")
        assert grown.status_code == 409 and "not the 3 you confirmed" in grown.text
        assert still_failed(db, "late") == 4
        unsaid = forget_all(client, base, csrf, "late", expected=None)
        assert unsaid.status_code == 400 and still_failed(db, "late") == 4
        again = forget_all(client, base, csrf, "late", expected="4")
        assert again.status_code == 200 and still_failed(db, "late") == 0
