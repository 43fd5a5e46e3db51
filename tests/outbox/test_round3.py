"""Issue 17 on the relay: a malformed row fails alone, the NOTIFY channel is the table's own
whatever its spelling, a publisher that cannot start is the relay's fault."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import create_engine, select, update
from sqlalchemy.engine import make_url

from consumerdedup import ConfigurationError, OutboxRelay, Publisher, RelayConfig
from consumerdedup.lifecycle import StopSwitch
from consumerdedup.outbox.listener import Listener
from consumerdedup.schema import Tables
from consumerdedup.testing import MemoryBroker
from tests.outbox.test_outbox import QUICK, add_events, outbox_rows
from tests.support.outbox_events import running


def test_a_row_with_malformed_headers_fails_alone_and_holds_only_its_key(db: Any) -> None:
    """Headers written by hand (a JSON string, a number as a value) used to raise from
    ``dict(row.headers)`` outside the publish handling: every round failed, for every key.
    Now that row is charged an attempt with the reason and holds back its key only."""
    ids = add_events(db, [("a1", "a"), ("a2", "a"), ("b1", "b"), ("c1", None), ("d1", "d")])
    ob = db.tables.outbox
    with db.engine.begin() as conn:
        conn.execute(update(ob).where(ob.c.event_id == ids[0]).values(headers="not an object"))
        conn.execute(update(ob).where(ob.c.event_id == ids[4]).values(headers={"n": 1}))
    broker = MemoryBroker()
    relay = OutboxRelay(db.engine, broker, tables=db.tables, config=QUICK)
    assert relay.run_once() == 2
    assert [m.body for m in broker.messages("orders")] == [b"b1", b"c1"]
    rows = {row.event_id: row for row in outbox_rows(db)}
    for bad in (ids[0], ids[4]):
        assert rows[bad].attempts == 1 and rows[bad].published_at is None
        assert "headers must be a JSON object of strings" in rows[bad].last_error
    assert rows[ids[1]].attempts == 0 and rows[ids[1]].published_at is None  # held behind a1
    with db.engine.begin() as conn:  # the operator repairs the row: it goes, then a2
        conn.execute(update(ob).where(ob.c.event_id == ids[0]).values(headers={}))
    relay.drain()
    assert [m.body for m in broker.messages("orders")] == [b"b1", b"c1", b"a1", b"a2"]
    with db.engine.connect() as conn:  # d1 is tried again each round, until parked
        assert conn.execute(select(ob.c.attempts).where(ob.c.event_id == ids[4])).scalar() > 1


def test_a_relay_spelling_the_table_otherwise_is_woken_by_the_trigger(
    pg: Any, postgres_url: str
) -> None:
    """Producer and trigger know the outbox as ``<schema>.outbox``; the relay as ``outbox``
    through its search_path. The NOTIFY channel used to be derived from the spelling (the
    relay listened on another channel and waited the whole poll interval, 60 s here); it is
    now the table's OID, resolved by PostgreSQL as the relay's locks are."""
    url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={pg.schema}"})
    engine = create_engine(url)
    tables = Tables.define(f"{pg.schema}.processed_events", "outbox")
    config = RelayConfig(poll_interval=timedelta(seconds=60))
    broker = MemoryBroker()
    relay = OutboxRelay(engine, broker, tables=tables, config=config)
    try:
        with running([relay]):
            add_events(pg, [("first", "k")])  # published by a round: the relay listens by then
            wait_until(lambda: len(broker.messages("orders")) == 1, "the first event", 20)
            started = time.monotonic()
            add_events(pg, [("second", "k")])
            wait_until(lambda: len(broker.messages("orders")) == 2, "a NOTIFY wake-up", 10)
            woke = time.monotonic() - started
    finally:
        engine.dispose()
    assert [m.body for m in broker.messages("orders")] == [b"first", b"second"]
    assert woke < 5 < config.poll_interval.total_seconds()


def test_a_listener_that_cannot_connect_warns_once_and_polls(
    pg: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The listener's connection is refused (a port nobody listens on): the relay still
    publishes by polling, and says so once at WARNING (it used to be a DEBUG line only)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    dead = create_engine(pg.engine.url.set(host="127.0.0.1", port=port))
    listener = Listener(dead, pg.tables.outbox)
    switch = StopSwitch()
    with caplog.at_level(logging.DEBUG, logger="consumerdedup.relay"):
        for _ in range(3):
            listener.wait(0.05, switch)
    said = [r for r in caplog.records if "cannot LISTEN" in r.getMessage()]
    assert [r.levelname for r in said][:1] == ["WARNING"], said
    assert [r.levelname for r in said].count("WARNING") == 1 and len(said) >= 2
    assert "polling" in said[0].getMessage()
    dead.dispose()


def wait_until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


def test_a_publisher_that_cannot_restart_mid_round_stops_the_relay_and_charges_nothing(
    db: Any,
) -> None:
    """A publisher that started, lost its producer and cannot start it again (a
    ConfigurationError from publish: KafkaPublisher rebuilding after a sequence error on a
    broker that now refuses it) is a setup fault: run_once raises it and no row is charged."""

    class Refusing(Publisher):
        def publish(self, *args: Any, **kwargs: Any) -> None:
            raise ConfigurationError("the broker refused the producer: change a setting")

    add_events(db, [("a1", "a"), ("b1", "b")])
    relay = OutboxRelay(db.engine, Refusing(), tables=db.tables, config=QUICK)
    with pytest.raises(ConfigurationError, match="change a setting"):
        relay.run_once()
    assert [(row.attempts, row.last_error) for row in outbox_rows(db)] == [(0, None)] * 2
