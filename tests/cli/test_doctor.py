"""``consumerdedup doctor`` on real PostgreSQL, SQLite and RabbitMQ: a healthy deployment
passes, and each broken one fails on the line that names what broke."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pika  # type: ignore[import-untyped]
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic  # type: ignore[import-untyped]
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from consumerdedup.cli.main import main
from consumerdedup.doctor import FAIL, diagnose, failed, require_startup, startup_checks
from consumerdedup.errors import ConfigurationError
from tests.conftest import Database
from tests.support.kafka_service import KafkaService, kafka_fixture  # noqa: F401
from tests.support.rabbitmq_service import amqp_url_fixture  # noqa: F401


def ago(age: timedelta) -> datetime:
    """``age`` before now, read when the row is written: a time taken at import would age
    with the run (after 5 minutes of other tests a 1-second-old event was stale)."""
    return datetime.now(UTC) - age


def doctor(db: Database, capsys: pytest.CaptureFixture[str], *args: str, url: str = "") -> Any:
    tables = ["--processed-events-table", db.tables.processed_events.fullname]
    tables += ["--outbox-table", db.tables.outbox.fullname]
    code = main(["--db", url or db.url, *tables, "doctor", *args])
    out = capsys.readouterr().out
    return code, out


def line(out: str, name: str) -> str:
    """The checklist line of check ``name`` with its fix line, if any."""
    lines = out.splitlines()
    for i, text_ in enumerate(lines):
        if text_.split()[1:2] == [name.split()[0]] and name in text_:
            fix = lines[i + 1] if i + 1 < len(lines) and "fix:" in lines[i + 1] else ""
            return f"{text_}\n{fix}"
    raise AssertionError(f"no line {name!r} in:\n{out}")


def statuses(out: str) -> list[tuple[str, str]]:
    """(name, status) of each FAIL line of the checklist."""
    found = re.findall(r"^  (FAIL)\s+(\S+(?: \S+)*?)\s{2,}", out, flags=re.MULTILINE)
    return [(name, status) for status, name in found]


def record(db: Database, consumer: str, age: timedelta) -> None:
    pe = db.tables.processed_events
    row = {"consumer": consumer, "message_id": uuid.uuid4().hex, "payload_hash": "h"}
    with db.engine.begin() as conn:
        conn.execute(insert(pe).values(**row, processed_at=ago(age), outcome="PROCESSED"))


def event(db: Database, age: timedelta, **extra: Any) -> None:
    values: dict[str, Any] = {"event_id": uuid.uuid4().hex, "destination": "d", "body": b"x"}
    values["headers"] = {}
    values |= {"created_at": ago(age), "available_at": ago(age), **extra}
    with db.engine.begin() as conn:
        conn.execute(insert(db.tables.outbox).values(**values))


def test_a_healthy_deployment_passes(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    record(db, "ledger", timedelta(hours=1))
    event(db, timedelta(seconds=1))
    code, out = doctor(db, capsys, "--retention", "7d")
    assert code == 0, out
    assert statuses(out) == [] and "warn" not in out
    assert "ok    old records" in out and "1 event(s) waiting" in out
    if db.dialect == "postgresql":
        assert "ok    notify trigger" in out and "ok    rights" in out


def test_a_healthy_partitioned_table_passes(
    pg_partitioned: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = doctor(pg_partitioned, capsys, "--retention", "7d", "--json")
    report = json.loads(out)
    assert code == 0 and report["ok"], out
    names = {c["name"]: c["status"] for c in report["checks"]}
    assert names["default partition"] == names["days ahead"] == "ok"


def test_a_dropped_index_fails_naming_it(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    index = "ix_outbox_unpublished"
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP INDEX {db.name(index)}"))
    code, out = doctor(db, capsys)
    assert code == 1
    found = line(out, "indexes")
    assert found.lstrip().startswith(FAIL) and index in found and "init-db" in found


def test_missing_tables_fail_naming_them(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {db.name('outbox')}"))
    code, out = doctor(db, capsys)
    assert code == 1
    found = line(out, "tables")
    assert FAIL in found and f"missing: {db.tables.outbox.fullname}" in found
    assert "init-db" in found


def test_a_missing_trigger_fails(pg: Database, capsys: pytest.CaptureFixture[str]) -> None:
    with pg.engine.begin() as conn:
        conn.execute(text(f"DROP TRIGGER outbox_notify ON {pg.name('outbox')}"))
    code, out = doctor(pg, capsys)
    assert code == 1
    found = line(out, "notify trigger")
    assert FAIL in found and "outbox_notify" in found and "missing" in found


def test_a_trigger_on_another_channel_fails(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    body = "BEGIN PERFORM pg_notify('somewhere_else', ''); RETURN NULL; END"
    with pg.engine.begin() as conn:
        conn.execute(
            text(
                f"CREATE OR REPLACE FUNCTION {pg.name('outbox_notify')}() RETURNS trigger "
                f"LANGUAGE plpgsql AS $${body}$$"
            )
        )
    code, out = doctor(pg, capsys)
    assert code == 1
    assert "the channel relays listen on" in line(out, "notify trigger")


def test_rows_in_the_default_partition_fail(
    pg_partitioned: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    record(pg_partitioned, "ledger", timedelta(days=40))  # no day partition that far back
    code, out = doctor(pg_partitioned, capsys, "--retention", "60d")
    assert code == 1
    found = line(out, "default partition")
    assert FAIL in found and "1 row(s) in" in found and "_default" in found


def test_records_past_their_window_fail(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    record(db, "ledger", timedelta(days=10))
    record(db, "mail", timedelta(days=10))
    code, out = doctor(db, capsys, "--retention", "2d", "--window", "mail=30d")
    assert code == 1
    found = line(out, "old records")
    assert FAIL in found and "ledger (oldest 10d" in found and "mail" not in found
    assert "pruner is not running" in found
    assert doctor(db, capsys, "--retention", "30d")[0] == 0


def test_parked_and_stale_events_fail(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    event(db, timedelta(hours=2))
    event(db, timedelta(hours=1), attempts=10, parked_at=ago(timedelta(0)), last_error="boom")
    code, out = doctor(db, capsys)
    assert code == 1
    assert "1 event(s) waiting" in line(out, "outbox backlog") and "over 5m" in out
    assert FAIL in line(out, "parked events") and "1 event(s) parked" in out
    failing = [n for n, status in statuses(doctor(db, capsys, "--outbox-max-age", "3h")[1])]
    assert failing == ["parked events"]


def test_an_autocommit_engine_fails(pg: Database) -> None:
    engine = create_engine(pg.url, isolation_level="AUTOCOMMIT")
    try:
        found = diagnose(engine, pg.tables)
    finally:
        engine.dispose()
    [bad] = failed(found)
    assert bad.name == "engine" and "AUTOCOMMIT" in bad.detail and "isolation_level" in bad.fix
    assert failed(diagnose(pg.engine, pg.tables)) == []


def test_an_unreachable_database_fails(
    sqlite_db: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"postgresql://postgres:s3cr3t@127.0.0.1:{port}/test"
    code, out = doctor(sqlite_db, capsys, url=url)
    assert code == 1
    found = line(out, "database")
    assert FAIL in found and f"127.0.0.1:{port}" in found and "Connection refused" in found
    assert "s3cr3t" not in out
    # At a process's start the same outage is a WARN: its own retry rides it out (b07efd8).
    checks = startup_checks(create_engine(url))
    assert failed(checks) == [] and [c.status for c in checks if c.name == "database"] == ["warn"]


@contextlib.contextmanager
def ttl_queue(url: str, days: int) -> Iterator[str]:
    connection: Any = pika.BlockingConnection(pika.URLParameters(url))
    name = f"cdd-doctor-{uuid.uuid4().hex[:10]}"
    channel = connection.channel()
    channel.queue_declare(name, arguments={"x-message-ttl": days * 86_400_000})
    try:
        yield name
    finally:
        channel.queue_delete(name)
        connection.close()


def test_a_window_shorter_than_the_queue_ttl_fails(
    sqlite_db: Database, amqp_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with ttl_queue(amqp_url, days=2) as queue:
        broker = ["--rabbitmq", amqp_url, "--queue", queue]
        code, out = doctor(sqlite_db, capsys, *broker, "--window", "ledger=1d")
        assert code == 1
        found = line(out, "window ledger")
        assert FAIL in found and "1d is shorter" in found and f"{queue}: 2d" in found
        assert "--window ledger=2d" in found
        code, out = doctor(sqlite_db, capsys, *broker, "--window", "ledger=3d")
        assert code == 0 and "ok    window ledger" in out, out


def test_a_role_without_write_rights_fails(
    pg: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    role = f"doctor_{uuid.uuid4().hex[:8]}"
    with pg.engine.begin() as conn:
        conn.execute(text(f"CREATE ROLE {role} LOGIN"))
        conn.execute(text(f"GRANT USAGE ON SCHEMA {pg.schema} TO {role}"))
        conn.execute(text(f"GRANT SELECT ON ALL TABLES IN SCHEMA {pg.schema} TO {role}"))
    try:
        url = make_url(pg.url).set(username=role).render_as_string(hide_password=False)
        code, out = doctor(pg, capsys, url=url)
        assert code == 1
        found = line(out, "rights")
        outbox = pg.tables.outbox.fullname
        assert FAIL in found and f"INSERT, UPDATE, DELETE on {outbox};" in found
        assert f"{role} lacks INSERT" in found and "SELECT," not in found.split("fix:")[0]
        assert f"TO {role}" in found and ("database", "FAIL") not in statuses(out)
    finally:
        with pg.engine.begin() as conn:
            conn.execute(text(f"DROP OWNED BY {role}"))
            conn.execute(text(f"DROP ROLE {role}"))


def test_a_read_only_sqlite_file_fails(
    sqlite_db: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    path = make_url(sqlite_db.url).database
    code, out = doctor(sqlite_db, capsys, url=f"sqlite:///file:{path}?mode=ro&uri=true")
    assert code == 1
    assert "a write was refused" in line(out, "rights") and "readonly" in out


def test_an_older_schema_version_fails(db: Database, capsys: pytest.CaptureFixture[str]) -> None:
    with db.engine.begin() as conn:
        conn.execute(text(f"UPDATE {db.name('consumerdedup_schema')} SET version = 0"))
    code, out = doctor(db, capsys)
    assert code == 1
    assert "0, older than this release's 1" in line(out, "schema version")


def test_a_broker_that_cannot_be_asked_is_a_fail_line(
    sqlite_db: Database, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = ["--rabbitmq", f"amqp://guest:pw9x@127.0.0.1:{port}/", "--queue", "q"]
    code, out = doctor(sqlite_db, capsys, *broker, "--consumer", "ledger")
    assert code == 1
    assert f"127.0.0.1:{port}" in line(out, "broker") and "pw9x" not in out
    assert "ok    tables" in out


def test_require_startup_names_what_stops_a_start(db: Database) -> None:
    require_startup(db.engine, db.tables)  # healthy: returns
    with db.engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {db.name('processed_events')}"))
    with pytest.raises(ConfigurationError, match=r"tables: missing: .*processed_events.*init-db"):
        require_startup(db.engine, db.tables)


def test_a_window_shorter_than_the_topic_retention_fails(
    sqlite_db: Database, kafka: KafkaService, capsys: pytest.CaptureFixture[str]
) -> None:
    topic = f"cdd-doctor-{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            configs = {"retention.ms": str(5 * 86_400_000)}
            await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
        finally:
            await admin.close()

    asyncio.run(create())
    broker = ["--kafka", kafka.bootstrap, "--topic", topic, "--consumer", "ledger"]
    code, out = doctor(sqlite_db, capsys, *broker, "--retention", "2d")
    assert code == 1
    found = line(out, "window ledger")
    assert FAIL in found and "2d is shorter" in found and f"{topic}: 5d" in found
    code, out = doctor(sqlite_db, capsys, *broker, "--retention", "2d", "--window", "ledger=5d")
    assert code == 0 and "ok    window ledger" in out, out
