"""100,000 FAILED records (one bulk INSERT) page through the admin page as fast near the
end as at the start: every page's statement, the one list_failed runs (records.page_query),
is an index scan of processed_events' primary key that stops at the page's end, whether
the search names a consumer or not, at the first page or 99,000 records deep (asserted on
PostgreSQL's plan, not on a timing). The pages walk in the browser and in JSON."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect
from sqlalchemy import text

from consumerdedup.admin import admin_app
from consumerdedup.failed import records
from consumerdedup.failed.records import Filters
from tests.admin.browser import chromium, shot
from tests.admin.server import postgres, served
from tests.conftest import Database

COUNT = 100_000


@pytest.fixture(scope="module")
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        pe = found.name("processed_events")
        with found.engine.begin() as conn:
            conn.execute(
                text(
                    f"INSERT INTO {pe} (consumer, message_id, processed_at, payload_hash, "
                    "outcome, error) SELECT CASE WHEN n % 10 = 0 THEN 'ledger' ELSE "
                    "'payments' END, 'm-' || lpad(n::text, 6, '0'), now() - n * interval "
                    "'1 second', md5(n::text), CASE WHEN n % 10 = 0 THEN 'processed' ELSE "
                    "'failed' END, CASE WHEN n % 10 = 0 THEN NULL ELSE 'KeyError: ''sku''' "
                    f"END FROM generate_series(1, {COUNT + COUNT // 9}) AS n"
                )
            )
            conn.execute(text(f"ANALYZE {pe}"))
        yield found


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        yield context.new_page()
        context.close()


def plan(db: Database, filters: Filters, after: str | None) -> str:
    query = records.page_query(filters, limit=50, after=after, tables=db.tables)
    compiled = query.compile(dialect=db.engine.dialect)
    with db.engine.connect() as conn:
        lines = conn.exec_driver_sql("EXPLAIN " + str(compiled), compiled.params).scalars()
        return "\n".join(lines)


def primary_key(db: Database) -> str:
    found = db.scalar(
        f"SELECT indexname FROM pg_indexes WHERE schemaname = '{db.schema}' AND tablename = "
        "'processed_events' AND indexdef LIKE '%(consumer, message_id)'"
    )
    assert isinstance(found, str)
    return found


def deep_cursor(db: Database, consumer: str | None) -> str:
    """The cursor of a page about 99,000 records in."""
    last = records.FailedRecord(consumer or "payments", "m-110000", datetime.now(UTC), None)
    return records.encode(last)


@pytest.mark.parametrize("consumer", ["payments", None])
def test_every_page_is_an_index_scan_that_stops_at_its_end(
    db: Database, consumer: str | None
) -> None:
    failed = db.scalar(
        f"SELECT count(*) FROM {db.name('processed_events')} WHERE outcome = 'failed'"
    )
    assert failed == COUNT
    index = primary_key(db)
    for after in (None, deep_cursor(db, consumer)):
        shown = plan(db, Filters(consumer=consumer), after)
        assert f"Index Scan using {index}" in shown, shown
        assert "Seq Scan" not in shown and "Sort" not in shown, shown
        assert shown.splitlines()[0].startswith("Limit"), shown


def test_the_pages_walk_in_the_browser_and_in_json(db: Database, page: Page, shots: Path) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base:
        page.goto(base + "/failures?consumer=payments")
        rows = page.locator("tr[data-message-id]")
        expect(rows).to_have_count(50)
        expect(rows.first).to_have_attribute("data-message-id", "m-000001")
        page.click("a[rel=next]")
        expect(rows).to_have_count(50)
        expect(rows.first).to_have_attribute("data-message-id", "m-000056")  # 10th: processed
        shot(page, shots, "failures-paged")
        with httpx.Client() as client:
            cursor = deep_cursor(db, "payments")
            found = client.get(
                f"{base}/failures.json",
                params={"consumer": "payments", "after": cursor, "limit": "1000"},
            ).json()
            ids = [r["message_id"] for r in found["records"]]
            assert ids[0] == "m-110001" and len(ids) == 1000 and ids == sorted(ids)
            assert "0" not in {i[-1] for i in ids}  # only the FAILED ones
            forged = client.get(f"{base}/failures.json", params={"after": cursor[:-3] + "xyz"})
            assert forged.status_code == 400
