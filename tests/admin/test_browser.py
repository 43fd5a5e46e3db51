"""The admin pages in headless Chromium against the real server (mounted at /admin),
PostgreSQL and RabbitMQ: an operator finds the five orders a bad deploy failed, replays
them after the fix with a preview and a confirmation, and sees them leave the list and
the messages processed; read-only mode shows no action and refuses the POST; the
outbox's parked key is seen and replayed; stuck and expired HTTP idempotency keys are
purged, live ones kept; a new FAILED record appears on the open Failures page without a
reload (and the page reads without JavaScript). Each page's screenshot is saved (to docs/admin/ when
$CONSUMERDEDUP_SCREENSHOTS=docs/admin; tests/admin/browser.py)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect
from sqlalchemy import insert, select, text, update
from sqlalchemy.orm import Session

from consumerdedup import Outbox
from consumerdedup.admin import Grant, RabbitMQReplay, Role, admin_app
from tests.admin.browser import chromium, shot
from tests.admin.key_fill import fill
from tests.admin.server import Audits, postgres, served
from tests.conftest import Database
from tests.failed.shop import IDS, RabbitShop
from tests.support.rabbitmq_service import Broker, rabbitmq_url

OPERATOR = Grant(Role.OPERATOR, "ops@example.com")


@pytest.fixture(scope="module")
def db(postgres_url: str) -> Iterator[Database]:
    with postgres(postgres_url) as found:
        noise = [
            {
                "consumer": "billing",
                "message_id": f"invoice-{n:03}",
                "processed_at": datetime.now(UTC),
                "payload_hash": "0" * 64,
                "outcome": "failed",
                "error": "TimeoutError: the tax service did not answer in 5 s",
            }
            for n in range(30)
        ]
        with found.engine.begin() as conn:
            conn.execute(insert(found.tables.processed_events), noise)
        yield found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with chromium() as found:
        yield found


@pytest.fixture(scope="module")
def broker() -> Iterator[Broker]:
    found = Broker(rabbitmq_url())
    yield found
    found.close()


def outcomes(db: Database, consumer: str) -> dict[str, str]:
    pe = db.name("processed_events")
    query = text(f"SELECT message_id, outcome FROM {pe} WHERE consumer = :c")
    with db.engine.connect() as conn:
        return {str(m): str(o) for m, o in conn.execute(query, {"c": consumer})}


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()


def test_an_operator_replays_the_failed_orders_after_the_fix(
    db: Database, broker: Broker, page: Page, shots: Path
) -> None:
    shop = RabbitShop(db, broker)
    shop.consume()  # the bad deploy: the five orders FAILED and dead-lettered
    assert outcomes(db, "shop") == dict.fromkeys(IDS, "failed")
    assert broker.reaches(shop.queue + ".dlq", 5) == 5
    audits = Audits()
    app = admin_app(
        db.engine,
        tables=db.tables,
        authorize=lambda request: OPERATOR,
        actions=True,
        replay=RabbitMQReplay(broker.url, {"shop": shop.queue + ".dlq"}),
        audit=audits,
    )
    with served(app) as base:
        page.goto(base + "/")
        expect(page.locator("h1")).to_have_text("Overview")
        expect(page.locator(".card", has_text="FAILED records")).to_contain_text("35")
        shot(page, shots, "overview")

        page.goto(base + "/failures")
        group = page.locator("table.groups tr", has_text="KeyError")
        expect(group).to_contain_text("shop")
        expect(group.locator("td.n")).to_have_text("5")
        shot(page, shots, "failures")
        group.locator("td.reason a").click()  # a group is its own search
        expect(page.locator("tr[data-message-id]")).to_have_count(5)
        page.goto(base + "/failures")

        page.fill("input[name=consumer]", "shop")
        page.fill("input[name=reason]", "sku")
        page.click("button:text('Search')")
        expect(page.locator("tr[data-message-id]")).to_have_count(5)
        shot(page, shots, "failures-search")

        page.click("a.record-link:text('order-1')")
        expect(page.locator("h1")).to_have_text("FAILED record")
        expect(page.locator("pre.reason")).to_contain_text("KeyError")
        shot(page, shots, "record")
        page.go_back()

        shop.field = "item"  # the fix is deployed
        page.check("input[name=scope][value=matching]")
        page.click("button[name=action][value=replay]")
        expect(page.locator(".preview .count")).to_have_text("5")
        assert outcomes(db, "shop") == dict.fromkeys(IDS, "failed")  # a preview changes nothing
        page.fill("textarea[name=why]", "sku fixed in deploy 42")
        page.check("input[name=confirm]")
        shot(page, shots, "confirm")
        page.click("button:text('Confirm replay')")
        expect(page.locator(".done")).to_contain_text("Replayed 5 of 5")

        shop.consume()  # the fixed consumer takes the replayed orders
        assert shop.applied() == IDS
        assert outcomes(db, "shop") == dict.fromkeys(IDS, "processed")
        page.goto(base + "/failures?consumer=shop")
        expect(page.locator("tr[data-message-id]")).to_have_count(0)
        page.goto(base + "/failures")
        expect(page.locator("table.groups")).not_to_contain_text("KeyError")
        expect(page.locator("tr[data-message-id]")).to_have_count(30)

        page.goto(base + "/explorer")
        page.fill("input[name=consumer]", "shop")
        page.fill("input[name=id]", "order-3")
        page.click("button:text('Look up')")
        expect(page.locator(".outcome")).to_have_text("PROCESSED")
        shot(page, shots, "explorer")
    [entry] = audits
    assert (entry.who, entry.action, entry.count) == (OPERATOR.who, "failed.replay", 5)
    assert entry.reason == "sku fixed in deploy 42" and sorted(entry.ids) == IDS


def test_read_only_shows_no_action_and_refuses_the_post(db: Database, page: Page) -> None:
    app = admin_app(db.engine, tables=db.tables, allow_loopback=True)
    with served(app) as base:
        page.goto(base + "/failures?consumer=billing")
        expect(page.locator("tr[data-message-id]")).to_have_count(30)
        expect(page.locator(".who")).to_contain_text("read-only")
        expect(page.locator("button[name=action]")).to_have_count(0)
        expect(page.locator("input[type=checkbox]")).to_have_count(0)
        page.click("a.record-link:text('invoice-000')")
        expect(page.locator("button[name=action]")).to_have_count(0)
        csrf = next(c["value"] for c in page.context.cookies() if "csrf" in c["name"])
        form = {"action": "forget", "scope": "matching", "consumer": "billing"}
        form |= {"csrf": csrf, "confirm": "yes", "why": "try"}
        refused = page.request.post(base + "/failures/apply", form=form)
        assert refused.status == 403 and "read-only" in refused.text()
    assert (
        db.scalar(f"SELECT count(*) FROM {db.name('processed_events')} WHERE consumer = 'billing'")
        == 30
    )


def test_a_parked_key_is_seen_with_what_it_holds_back_and_replayed(
    db: Database, page: Page, shots: Path
) -> None:
    outbox = Outbox(db.tables)
    with Session(db.engine) as session, session.begin():
        ids = [
            outbox.add(session, "orders.paid", f'{{"order": {n}}}'.encode(), key="customer-7")
            for n in range(3)
        ]
        other = outbox.add(session, "orders.refunded", b"{}", key="customer-9")
    ob = db.tables.outbox
    with db.engine.begin() as conn:
        conn.execute(
            update(ob)
            .where(ob.c.event_id.in_([ids[0], other]))
            .values(attempts=10, parked_at=datetime.now(UTC), parked_reason="NoRoute: orders")
        )
    audits = Audits()
    app = admin_app(
        db.engine, tables=db.tables, authorize=lambda request: OPERATOR, actions=True, audit=audits
    )
    with served(app) as base:
        page.goto(base + "/outbox")
        expect(page.locator("table", has_text="Destination").first).to_contain_text("orders.paid")
        page.click(f"a:text('{ids[0]}')")
        expect(page.locator("main")).to_contain_text("2 unpublished event(s) of key customer-7")
        expect(page.locator("main")).to_contain_text("(hidden")  # bodies only when allowed
        shot(page, shots, "outbox-event")
        page.goto(base + "/outbox")
        expect(page.locator("input[name=id]")).to_have_count(2)
        shot(page, shots, "outbox")
        page.fill("input[name=destination]", "orders.paid")
        page.click("button:text('Search')")
        expect(page.locator("input[name=id]")).to_have_count(1)
        page.check("input[name=scope][value=all]")  # every parked event this search matches
        page.click("button[name=action][value=replay]")
        expect(page.locator(".preview .count")).to_have_text("1")
        page.fill("textarea[name=why]", "route declared")
        page.check("input[name=confirm]")
        page.click("button:text('Confirm replay')")
        expect(page.locator(".done")).to_contain_text(re.compile(r"Replayed\s+1 of 1"))
    query = text(f"SELECT event_id, attempts, parked_at FROM {db.name('outbox')}")
    with db.engine.connect() as conn:
        rows = {event_id: (n, at) for event_id, n, at in conn.execute(query)}
    assert rows[ids[0]] == (0, None) and rows[other][0] == 10 and rows[other][1] is not None
    [entry] = audits
    assert (entry.action, entry.count, entry.ids) == ("outbox.replay", 1, [ids[0]])
    assert entry.target == {"scope": "all", "search": {"destination": "orders.paid"}}


def test_stuck_and_expired_idempotency_keys_are_purged_and_live_ones_kept(
    db: Database, page: Page, shots: Path
) -> None:
    fill(db)
    audits = Audits()
    app = admin_app(
        db.engine, tables=db.tables, authorize=lambda request: OPERATOR, actions=True, audit=audits
    )
    with served(app) as base:
        page.goto(base + "/keys")
        rows = page.locator("tr[data-key]")
        expect(rows).to_have_count(6)
        expect(page.locator("input[name=pick]")).to_have_count(3)  # expired x2, abandoned
        shot(page, shots, "keys")
        page.select_option("select[name=condition]", "abandoned")
        page.click("button:text('Search')")
        expect(rows).to_have_count(1)
        expect(rows.first).to_have_attribute("data-key", "abandoned")
        page.goto(base + "/keys")
        page.click("a:text-is('live')")
        expect(page.locator("dl.record")).to_contain_text("201")
        expect(page.locator("dl.record")).to_contain_text("(hidden")
        expect(page.locator("button[name=action]")).to_have_count(0)  # a live key stays
        shot(page, shots, "key")
        page.goto(base + "/keys")
        page.check("tr[data-key=abandoned] input[name=pick]")
        page.check("tr[data-key=expired] input[name=pick]")
        page.click("button[name=action][value=purge]")
        expect(page.locator(".preview .count")).to_have_text("2")
        page.fill("textarea[name=why]", "worker died during deploy")
        page.check("input[name=confirm]")
        page.click("button:text('Confirm purge')")
        expect(page.locator(".done")).to_contain_text("Purged 2 of 2")
    table = db.tables.idempotency_keys
    with db.engine.connect() as conn:
        left = set(conn.execute(select(table.c.key)).scalars())
    assert left == {"live", "running", "expired-not-stored", "live-order"}
    [entry] = audits
    said = (entry.action, entry.count, sorted(entry.ids))
    assert said == ("keys.purge", 2, ["abandoned", "expired"])


@pytest.fixture
def own_db(postgres_url: str) -> Iterator[Database]:
    """A schema of the test's own: the module's records and counts stay as the others
    expect them, in whatever order the tests run."""
    with postgres(postgres_url) as found:
        yield found


def test_a_new_failed_record_appears_live_and_the_page_reads_without_javascript(
    own_db: Database, browser: Browser, page: Page, shots: Path
) -> None:
    db, consumer = own_db, f"live-{uuid.uuid4().hex[:8]}"

    def failed(message_id: str) -> None:
        row = {"consumer": consumer, "message_id": message_id, "payload_hash": "0" * 64,
               "processed_at": datetime.now(UTC), "outcome": "failed",
               "error": "KeyError: 'sku'"}  # fmt: skip
        with db.engine.begin() as conn:
            conn.execute(insert(db.tables.processed_events), [row])

    failed("m-1")
    failed("m-2")
    app = admin_app(db.engine, tables=db.tables, authorize=lambda request: OPERATOR, actions=True)
    quiet = browser.new_context(java_script_enabled=False)
    with served(app) as base:
        url = f"{base}/failures?consumer={consumer}&live=2"
        plain = quiet.new_page()
        plain.goto(url)
        expect(plain.locator("tr[data-message-id]")).to_have_count(2)  # read without script
        expect(plain.locator("[data-live-status]")).to_be_hidden()

        page.goto(url)
        status = page.locator("[data-live-status]")
        expect(status).to_contain_text("Live: every 2 s")
        page.evaluate("window.sameDocument = true")  # gone if the page reloaded
        page.check("tr[data-message-id='m-1'] input[name=key]")
        page.check("input[name=scope][value=matching]")
        failed("m-3")  # a new failure while the operator looks
        rows = page.locator("tr[data-message-id]")
        expect(rows).to_have_count(3, timeout=15_000)
        expect(page.locator("table.groups td.n")).to_have_text("3")
        expect(status).to_contain_text("updated")
        assert page.evaluate("window.sameDocument") is True
        expect(page.locator("tr[data-message-id='m-1'] input[name=key]")).to_be_checked()
        expect(page.locator("tr[data-message-id='m-3'] input[name=key]")).not_to_be_checked()
        expect(page.locator("input[name=scope][value=matching]")).to_be_checked()
        shot(page, shots, "failures-live")

        status.locator("button").click()
        expect(status).to_contain_text("Live refresh paused.")
        expect(plain.locator("tr[data-message-id]")).to_have_count(2)  # no script: as served
    quiet.close()
