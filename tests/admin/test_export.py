"""The export of a Failures search (NDJSON and CSV, every page streamed) from the real
server: exactly the records the search matches, and a cell a spreadsheet would run as a
formula (a hostile producer's id or reason) neutralised; the overview refreshes itself
without JavaScript when asked, never more often than every 5 seconds."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import pytest
from sqlalchemy import insert

from consumerdedup.admin import admin_app
from tests.admin.server import postgres, served

HOSTILE = '=HYPERLINK("http://evil.example","click")'


@pytest.fixture(scope="module")
def base(postgres_url: str) -> Iterator[str]:
    with postgres(postgres_url) as db:
        rows = [
            {
                "consumer": "payments",
                "message_id": f"p-{n:04}",
                "processed_at": datetime.now(UTC),
                "payload_hash": "0" * 64,
                "outcome": "failed",
                "error": "KeyError: 'sku'" if n % 2 else "TimeoutError: tax",
            }
            for n in range(2500)
        ]
        rows.append({**rows[0], "message_id": "+1-555", "error": HOSTILE})
        with db.engine.begin() as conn:
            conn.execute(insert(db.tables.processed_events), rows)
        with served(admin_app(db.engine, tables=db.tables, allow_loopback=True)) as found:
            yield found


def records_of(db_base: str, **search: str) -> httpx.Response:
    with httpx.Client() as client:
        return client.get(f"{db_base}/failures/export", params=search)


def test_ndjson_has_every_record_the_search_matches(base: str) -> None:
    found = records_of(base, consumer="payments", reason="keyerror", format="ndjson")
    assert found.status_code == 200 and found.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in found.text.splitlines()]
    assert len(lines) == 1250  # across two pages of 1,000
    assert {line["reason"] for line in lines} == {"KeyError: 'sku'"}
    assert len({line["message_id"] for line in lines}) == 1250
    assert records_of(base, format="xml").status_code == 400


def test_csv_neutralises_formulas(base: str) -> None:
    found = records_of(base, message_id="+1", format="csv")
    assert found.status_code == 200 and "attachment" in found.headers["content-disposition"]
    rows = list(csv.reader(io.StringIO(found.text)))
    assert rows[0] == ["consumer", "message_id", "failed_at", "reason"]
    [row] = rows[1:]
    assert row[1] == "'+1-555" and row[3] == "'" + HOSTILE


def test_the_overview_refreshes_itself_when_asked(base: str) -> None:
    with httpx.Client() as client:
        assert 'http-equiv="refresh"' not in client.get(f"{base}/overview").text
        asked = client.get(f"{base}/overview", params={"refresh": "1"}).text
        assert '<meta http-equiv="refresh" content="5">' in asked
