"""The built-in audit table: ``consumerdedup init-db --admin-audit`` creates
``admin_audit`` beside the library's tables; ``admin_app(audit="table")`` refuses to start
without it (an action would go unaudited); each action taken through the real server
(httpx) is one row: who, as which role, what, on which search, how many, why, when; the
Audit page lists the rows newest first, in keyset pages, in HTML and JSON."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import create_engine, insert, select

from consumerdedup.admin import AuditTable, Grant, Role, admin_app
from consumerdedup.errors import ConfigurationError
from tests.admin.server import postgres, served
from tests.conftest import Database
from tests.support.cli import Cli, cli_fixture, database_options  # noqa: F401

OPERATOR = Grant(Role.OPERATOR, "ops@example.com")


@pytest.fixture
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        yield found


def failed(db: Database, consumer: str, *ids: str) -> None:
    rows = [
        {"consumer": consumer, "message_id": i, "processed_at": datetime.now(UTC),
         "payload_hash": "0" * 64, "outcome": "failed", "error": "KeyError: 'sku'"}
        for i in ids
    ]  # fmt: skip
    with db.engine.begin() as conn:
        conn.execute(insert(db.tables.processed_events), rows)


def forget(client: httpx.Client, consumer: str, why: str, expected: int) -> httpx.Response:
    csrf = client.get("/failures.json").json()["csrf"]
    form = {"action": "forget", "scope": "matching", "consumer": consumer, "csrf": csrf,
            "confirm": "yes", "why": why, "expected": str(expected)}  # fmt: skip
    return client.post("/failures/apply", data=form)


def test_without_the_table_the_app_refuses_to_start(db: Database) -> None:
    with pytest.raises(ConfigurationError, match=r"init-db --admin-audit"):
        admin_app(db.engine, tables=db.tables, allow_loopback=True, audit="table")
    with pytest.raises(ConfigurationError, match="audit must be callable or 'table'"):
        admin_app(db.engine, tables=db.tables, allow_loopback=True, audit="tabel")  # type: ignore[arg-type]


def test_each_action_is_a_row_shown_on_the_audit_page(db: Database, cli: Cli) -> None:
    made = cli(db, "init-db", "--admin-audit")
    assert made.returncode == 0, made.stderr
    assert f"admin audit table {db.schema}.admin_audit ready" in made.stdout
    assert cli(db, "init-db", "--admin-audit").returncode == 0  # idempotent
    consumer = f"shop-{uuid.uuid4().hex[:6]}"
    failed(db, consumer, "order-1", "order-2", "order-3")
    failed(db, "billing", "invoice-1")
    app = admin_app(
        db.engine, tables=db.tables, authorize=lambda request: OPERATOR, actions=True,
        audit="table",
    )  # fmt: skip
    with served(app) as base, httpx.Client(base_url=base, timeout=10) as client:
        assert forget(client, consumer, "sku fixed in deploy 42", 3).status_code == 200
        assert forget(client, "billing", "tax service back", 1).status_code == 200
        refused = forget(client, consumer, "nothing left", 0)  # matches none: one more row
        assert refused.status_code == 200
        html = client.get("/audit")
        assert html.status_code == 200 and 'href="/admin/audit"' in html.text
        assert html.text.count("data-audit-id") == 3
        assert html.text.index("tax service back") < html.text.index("sku fixed in deploy 42")
        first = client.get("/audit.json", params={"limit": "2"}).json()
        assert [e["reason"] for e in first["entries"]] == ["nothing left", "tax service back"]
        older = client.get("/audit.json", params={"limit": "2", "before": first["before"]})
        [entry] = older.json()["entries"]
        assert older.json()["before"] is None
        assert client.get("/audit.json", params={"before": "x"}).status_code == 400
    assert (entry["who"], entry["role"], entry["action"]) == (OPERATOR.who, "operator",
                                                              "failed.forget")  # fmt: skip
    assert entry["count"] == 3 and sorted(entry["ids"]) == ["order-1", "order-2", "order-3"]
    assert entry["target"]["search"] == {"consumer": consumer}
    assert entry["error"] is None and entry["at"].startswith(str(datetime.now(UTC).year))
    table = AuditTable(db.engine, tables=db.tables).table
    with db.engine.connect() as conn:
        counts = list(conn.execute(select(table.c.count).order_by(table.c.id)).scalars())
    assert counts == [3, 1, 0]


def test_without_an_audit_table_there_is_no_audit_page(db: Database) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base, httpx.Client(base_url=base, timeout=10) as client:
        assert client.get("/audit").status_code == 404
        assert 'href="/admin/audit"' not in client.get("/failures").text


def test_a_database_not_reached_yet_is_not_a_missing_table(
    caplog: pytest.LogCaptureFixture,
) -> None:
    away = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/test")  # nothing listens
    try:
        app = admin_app(away, allow_loopback=True, audit="table")  # a service up before its db
    finally:
        away.dispose()
    assert app.state.audit_table is not None
    assert "admin audit table admin_audit not checked" in caplog.text
