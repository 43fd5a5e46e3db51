"""process_once: a hand-written loop's message through the runners' pipeline, on PostgreSQL."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import (
    AsyncDeduplicator,
    CircuitOpen,
    ConfigurationError,
    Deduplicator,
    Message,
    Outcome,
    PermanentError,
    Result,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.adapters.kafka.convert import coordinates_id
from consumerdedup.failed import list_failed
from consumerdedup.integrations.kafka_records import kafka_message
from consumerdedup.integrations.process_once import process_once, process_once_async
from tests.conftest import Database
from tests.telemetry.conftest import Otel, otel  # noqa: F401

FAST = RetryPolicy(attempts=2, initial_delay=timedelta(0), max_delay=timedelta(0))


def _rows(pg: Database, ledger: str) -> list[tuple[Any, ...]]:
    with pg.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(text(f"SELECT message_id, amount FROM {ledger}"))]


def _records(pg: Database) -> list[tuple[str, str]]:
    with pg.engine.connect() as conn:
        found = conn.execute(
            text(f"SELECT message_id, outcome FROM {pg.name('processed_events')} ORDER BY 1")
        )
        return [(r[0], r[1]) for r in found]


def _ledger_handler(pg: Database, ledger: str, **options: Any) -> Any:
    dedup = Deduplicator(pg.engine, "loop", tables=pg.tables, retry=FAST, **options)

    @dedup.handler
    def charge(message: Message, session: Session) -> None:
        body = message.json()
        if body.get("fail"):
            raise PermanentError("card declined")
        if body.get("later"):
            raise RetryLater("the bank is busy")
        session.execute(
            text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', :n, :id)"),
            {"n": body["amount"], "id": message.id},
        )

    return charge


def test_twice_delivered_applies_once(pg: Database) -> None:
    ledger = pg.create_ledger()
    with process_once(_ledger_handler(pg, ledger)) as once:
        first = once(Message(id="m-1", body=b'{"amount": 5}'))
        again = once(Message(id="m-1", body=b'{"amount": 5}'))
    assert isinstance(first, Result)
    assert (first.outcome, again.outcome) == (Outcome.PROCESSED, Outcome.DUPLICATE)
    assert _rows(pg, ledger) == [("m-1", 5)]
    assert _records(pg) == [("m-1", "processed")]


def test_failed_is_recorded_dead_lettered_and_listed(pg: Database) -> None:
    ledger = pg.create_ledger()
    letters: list[Result] = []
    once = process_once(_ledger_handler(pg, ledger, dead_letter=letters.append))
    result = once(Message(id="m-bad", body=b'{"amount": 1, "fail": true}'))
    assert result.outcome is Outcome.FAILED
    assert result.reason is not None and "card declined" in result.reason
    assert [letter.message.id for letter in letters] == ["m-bad"]
    assert _rows(pg, ledger) == []
    page = list_failed(pg.engine, tables=pg.tables)
    assert [(r.consumer, r.message_id) for r in page.records] == [("loop", "m-bad")]
    # delivered again: refused by its record, the handler not run again
    assert once(Message(id="m-bad", body=b'{"amount": 1, "fail": true}')).outcome is Outcome.FAILED
    assert _records(pg) == [("m-bad", "failed")]


def test_retry_records_nothing(pg: Database) -> None:
    ledger = pg.create_ledger()
    once = process_once(_ledger_handler(pg, ledger))
    result = once(Message(id="m-later", body=b'{"amount": 1, "later": true}'))
    assert result.outcome is Outcome.RETRY
    assert not result.outcome.acks
    assert _records(pg) == [] and _rows(pg, ledger) == []


def test_open_breaker_stops_the_loop(pg: Database) -> None:
    ledger = pg.create_ledger()
    dedup = Deduplicator(
        pg.engine,
        "loop",
        tables=pg.tables,
        retry=RetryPolicy(attempts=1, breaker_threshold=2),
    )

    @dedup.handler
    def broken(message: Message, session: Session) -> None:
        raise KeyError("renamed_field")

    once = process_once(broken)
    for n in (1, 2):
        assert once(Message(id=f"m-{n}", body=b"{}")).outcome is Outcome.FAILED
    assert once.breaker.open
    with pytest.raises(CircuitOpen):
        once(Message(id="m-3", body=b"{}"))
    assert [m for m, _ in _records(pg)] == ["m-1", "m-2"]  # m-3 untried: stays with the broker
    assert _rows(pg, ledger) == []


def test_refuses_what_is_not_a_message_or_a_handler(pg: Database) -> None:
    with pytest.raises(ConfigurationError, match="handler"):
        process_once(lambda message, session: None)
    once = process_once(_ledger_handler(pg, pg.create_ledger()))
    with pytest.raises(ConfigurationError, match=r"process_once\(message\)"):
        once({"id": "m-1"})  # type: ignore[arg-type]


def test_async_twin(pg: Database) -> None:
    ledger = pg.create_ledger()

    async def scenario() -> list[Outcome]:
        engine = pg.async_engine()
        dedup = AsyncDeduplicator(engine, "loop", tables=pg.tables, retry=FAST)

        @dedup.handler
        async def charge(message: Message, session: Any) -> None:
            await session.execute(
                text(f"INSERT INTO {ledger} (account, amount, message_id) VALUES ('a', 7, :id)"),
                {"id": message.id},
            )

        once = process_once_async(charge)
        message = Message(id="m-a", body=b"{}")
        # two deliveries of one message at once: the claim makes the twin wait, then DUPLICATE
        results = await asyncio.gather(once(message), once(message))
        await engine.dispose()
        return sorted(r.outcome.value for r in results)  # type: ignore[misc]

    assert asyncio.run(scenario()) == ["duplicate", "processed"]
    assert _rows(pg, ledger) == [("m-a", 7)]


class _ConfluentLike:
    """A confluent-kafka Message's shape: every field is a method."""

    def __init__(self, topic: str, headers: list[tuple[str, bytes]] | None) -> None:
        self._topic, self._headers = topic, headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return 3

    def offset(self) -> int:
        return 41

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._headers

    def value(self) -> bytes:
        return b"{}"

    def timestamp(self) -> tuple[int, int]:
        return (1, 1_700_000_000_000)


@pytest.mark.parametrize("topic", ["orders", "t" * 249])
def test_kafka_key_is_the_runners(topic: str) -> None:
    record = _ConfluentLike(topic, None)
    message = kafka_message(record)

    class Aio:  # aiokafka's ConsumerRecord: attributes
        partition, offset = 3, 41

    Aio.topic = topic  # type: ignore[attr-defined]
    assert message.id == coordinates_id(Aio)
    assert (message.source, message.partition, message.offset) == (topic, 3, 41)
    assert message.timestamp is not None
    assert kafka_message(_ConfluentLike(topic, [("event_id", b"e-1")])).id == "e-1"
    assert kafka_message(_ConfluentLike(topic, [("event_id", b"\xff")])).id == b"\xff"


def test_same_telemetry_as_a_runner(pg: Database, otel: Otel) -> None:  # noqa: F811
    """The runners' span per message, and their consumed-messages metric, from a loop."""
    ledger = pg.create_ledger()
    once = process_once(_ledger_handler(pg, ledger))
    once(Message(id="m-t", body=b'{"amount": 1}', source="orders"))
    once(Message(id="m-t", body=b'{"amount": 1}', source="orders"))
    spans = otel.named("process orders")
    outcomes = [dict(span.attributes or {})["consumerdedup.outcome"] for span in spans]
    assert outcomes == ["processed", "duplicate"]
    consumed = otel.points("messaging.client.consumed.messages")
    assert sum(point.value for point in consumed) == 2
