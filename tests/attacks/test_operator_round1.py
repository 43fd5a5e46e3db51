"""Round 1 of attacks on the operator tools (issue 23), through the public API and CLI,
against the real services: each test is one way a tool could lose or double an effect,
leak a value, or say something untrue."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Connection, create_engine, insert, text

from consumerdedup.cli.main import main
from consumerdedup.db import catalog
from consumerdedup.doctor import require_startup
from consumerdedup.errors import ConfigurationError
from consumerdedup.failed import kafka as kafka_replay
from consumerdedup.failed import rabbitmq
from consumerdedup.headers import CONSUMER_HEADER
from consumerdedup.reasons import describe
from consumerdedup.schema import Tables, install
from tests.conftest import Database
from tests.failed.shop import IDS, KafkaShop, RabbitShop, kafka_shop
from tests.support.kafka_service import KafkaService, Topics, kafka_fixture, topics_fixture  # noqa: F401
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401


def _doctor(db: Database, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    tables = ["--processed-events-table", db.tables.processed_events.fullname]
    tables += ["--outbox-table", db.tables.outbox.fullname]
    code = main(["--db", db.url, *tables, "doctor"])
    return code, capsys.readouterr().out


def test_doctor_fails_an_index_of_our_name_on_other_columns(
    db: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    ob = db.tables.outbox
    index = next(i for i in ob.indexes if str(i.name).endswith("published_at"))
    qualified = f"{db.schema}.{index.name}" if db.schema else str(index.name)
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {qualified}"))
        conn.execute(text(f"CREATE INDEX {index.name} ON {db.name(ob.name)} (destination)"))
    code, out = _doctor(db, capsys)
    assert code == 1 and str(index.name) in out, out


def test_doctor_fails_a_dropped_primary_key(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    pe = pg.tables.processed_events
    with pg.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {pg.name(pe.name)} DROP CONSTRAINT {pe.name}_pkey"))
    code, out = _doctor(pg, capsys)
    assert code == 1, out


def test_doctor_fails_a_dropped_event_id_unique(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    ob = pg.tables.outbox
    with pg.engine.begin() as conn:
        name = conn.execute(
            text(
                "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(:t) "
                "AND contype = 'u'"
            ),
            {"t": pg.name(ob.name)},
        ).scalar_one()
        conn.execute(text(f"ALTER TABLE {pg.name(ob.name)} DROP CONSTRAINT {name}"))
    code, out = _doctor(pg, capsys)
    assert code == 1, out


def test_a_card_number_quoted_as_an_identifier_is_masked(pg: Database) -> None:
    card = "4111111111111111"
    with pytest.raises(Exception) as caught, pg.engine.connect() as conn:
        conn.execute(text(f'SELECT 1 FROM {pg.name("outbox")} WHERE key = "{card}"'))
    said = describe(caught.value)
    assert card not in said, said


def test_install_remakes_an_index_of_our_name_on_other_columns(db: Database) -> None:
    ob = db.tables.outbox
    index = next(i for i in ob.indexes if str(i.name).endswith("unpublished"))
    qualified = f"{db.schema}.{index.name}" if db.schema else str(index.name)
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {qualified}"))
        conn.execute(text(f"CREATE INDEX {index.name} ON {db.name(ob.name)} (destination)"))
    install(db.engine, db.tables)
    with db.engine.connect() as conn:
        assert catalog.missing_indexes(conn, ob) == []


def test_install_and_startup_refuse_a_table_without_its_key(pg: Database) -> None:
    pe = pg.tables.processed_events
    with pg.engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {pg.name(pe.name)} DROP CONSTRAINT {pe.name}_pkey"))
    with pytest.raises(ConfigurationError, match="primary key"):
        install(pg.engine, pg.tables)
    with pytest.raises(ConfigurationError, match="keys: missing: primary key"):
        require_startup(pg.engine, pg.tables)


def test_failed_list_prints_no_control_character_of_a_message_id(
    db: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    """A message id is the producer's text: a newline in it forged a table row, an escape
    sequence rewrote the operator's terminal."""
    forged = "m1\nbilling  m2  2026-01-01 00:00:00 \x1b[2K\rforgot"
    with db.engine.begin() as conn:
        conn.execute(
            insert(db.tables.processed_events).values(
                consumer="billing",
                message_id=forged,
                processed_at=datetime.now(UTC),
                payload_hash="0" * 64,
                outcome="failed",
                error="KeyError: 'sku'",
            )
        )
    base = ["--db", db.url, "--processed-events-table", db.tables.processed_events.fullname]
    assert main([*base, "failed", "list"]) == 0
    listed = capsys.readouterr().out
    assert main([*base, "forget", "--consumer", "billing", forged, "--dry-run"]) == 0
    said = capsys.readouterr().out
    for out in (listed, said):
        assert "\x1b" not in out and "\r" not in out, out
    assert len(listed.splitlines()) == 3, listed  # header, the record, (last page)
    assert len(said.splitlines()) == 1 and "m1\\n" in said, said


def test_two_installs_at_once_both_succeed(postgres_url: str) -> None:
    """The second install() read the catalog while the first had created the schema but not
    committed, then failed on pg_namespace's unique index. Now it waits for the first."""
    schema = f"race_{uuid.uuid4().hex[:12]}"
    tables = Tables.define(f"{schema}.processed_events", f"{schema}.outbox")
    first = create_engine(postgres_url)
    second = create_engine(postgres_url, connect_args={"application_name": schema})
    errors: list[BaseException] = []

    def other() -> None:
        try:
            install(second, tables)
        except BaseException as error:  # reported by the assertion below
            errors.append(error)

    try:
        with first.begin() as conn:
            install(conn, tables)
            racer = threading.Thread(target=other)
            racer.start()
            deadline = time.monotonic() + 30
            while not errors and not _waiting(conn, schema):  # until the second waits on us
                assert time.monotonic() < deadline, "the second install never waited"
        racer.join(timeout=30)
        assert not errors, describe(errors[0])
    finally:
        with first.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        first.dispose()
        second.dispose()


def _waiting(conn: Connection, application_name: str) -> bool:
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = :a "
        "AND wait_event_type = 'Lock'"
    )
    with conn.engine.connect() as probe:
        return bool(probe.execute(query, {"a": application_name}).scalar())


@pytest.fixture
def bad_deploy(pg: Database, rabbit: Broker) -> RabbitShop:
    """tests/failed's shop after its bad deploy: 5 orders FAILED, in the DLQ."""
    shop = RabbitShop(pg, rabbit)
    shop.consume()
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5
    return shop


def test_a_replay_to_a_deleted_queue_keeps_letters_and_records(bad_deploy: RabbitShop) -> None:
    """The source queue is gone: each dead letter stays in the DLQ, and its FAILED record
    stays listed (before: forgotten although nothing went back)."""
    shop = bad_deploy
    shop.rabbit.channel.queue_delete(shop.queue)
    report = rabbitmq.replay(
        shop.db.engine, shop.rabbit.url, shop.queue + ".dlq", tables=shop.db.tables
    )
    assert report.replayed == [] and len(report.kept) == 5
    assert "no queue" in report.kept[0][1]
    assert shop.rabbit.ready(shop.queue + ".dlq") == 5
    assert report.forgotten == 0 and shop.outcomes() == dict.fromkeys(IDS, "failed")


def test_dead_letters_without_our_headers_stay_where_they_are(bad_deploy: RabbitShop) -> None:
    shop = bad_deploy
    dlq = shop.queue + ".dlq"
    shop.rabbit.publish(dlq, b"{}", "foreign-1")
    shop.rabbit.publish(dlq, b"{}", None, headers={CONSUMER_HEADER: "shop"})
    report = rabbitmq.replay(shop.db.engine, shop.rabbit.url, dlq, tables=shop.db.tables)
    assert len(report.replayed) == 5 and len(report.kept) == 2
    assert shop.rabbit.ready(dlq) == 2
    assert shop.outcomes() == {}


@pytest.fixture
async def kafka_bad_deploy(pg: Database, kafka: KafkaService, topics: Topics) -> KafkaShop:
    """tests/failed's Kafka shop after its bad deploy: 5 orders FAILED, in the DLQ topic."""
    shop = await kafka_shop(pg, kafka, topics)
    await shop.consume()
    return shop


async def test_a_kafka_replay_to_a_missing_topic_forgets_nothing(
    kafka_bad_deploy: KafkaShop,
) -> None:
    """Before: the broker auto-created the mistyped topic: all 5 'replayed' into a topic
    nobody reads, their FAILED records forgotten and the DLQ offsets committed past them,
    so no later replay would take them again."""
    shop = kafka_bad_deploy
    report = await kafka_replay.replay_async(
        shop.db.engine,
        shop.kafka.bootstrap,
        shop.topic + ".dlq",
        tables=shop.db.tables,
        to=f"gone-{uuid.uuid4().hex[:8]}",
    )
    assert report.replayed == [] and report.forgotten == 0
    assert "no topic" in report.kept[0][1]
    assert shop.outcomes() == dict.fromkeys(IDS, "failed")


def test_doctor_names_a_trigger_calling_another_function(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: 'outbox_notify is not AFTER INSERT FOR EACH STATEMENT', which it was."""
    trigger, function = pg.tables.notify_names
    outbox = pg.name(pg.tables.outbox.name)
    with pg.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE FUNCTION {pg.schema}.other() RETURNS trigger LANGUAGE plpgsql "
                "AS $$ BEGIN RETURN NULL; END $$"
            )
        )
        conn.execute(text(f'DROP TRIGGER "{trigger}" ON {outbox}'))
        conn.execute(
            text(
                f'CREATE TRIGGER "{trigger}" AFTER INSERT ON {outbox} '
                f"FOR EACH STATEMENT EXECUTE FUNCTION {pg.schema}.other()"
            )
        )
    code, out = _doctor(pg, capsys)
    assert code == 1 and f"calling another function, not {function}()" in out, out


def test_two_replays_at_once_apply_each_order_once(bad_deploy: RabbitShop) -> None:
    shop = bad_deploy
    dlq = shop.queue + ".dlq"
    reports: list[Any] = []

    def replay() -> None:
        reports.append(rabbitmq.replay(shop.db.engine, shop.rabbit.url, dlq, tables=shop.db.tables))

    racers = [threading.Thread(target=replay) for _ in range(2)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=60)
    assert sum(len(r.replayed) for r in reports) == 5 and not any(r.kept for r in reports)
    shop.field = "item"  # the fix
    shop.consume()
    assert shop.applied() == IDS and shop.rabbit.ready(dlq) == 0
