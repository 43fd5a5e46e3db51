"""Process spans for the outcomes that are not the happy path: a RETRY that recovers
(its attempts linked), a FAILED message (its error recorded, scrubbed), a batch."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode
from sqlalchemy import text
from sqlalchemy.orm import Session

from consumerdedup import (
    Deduplicator,
    Message,
    Outbox,
    OutboxRelay,
    RetryLater,
    RetryPolicy,
)
from consumerdedup.testing import MemoryBroker, MemoryConfig, MemoryConsumerRunner
from tests.telemetry.conftest import Otel

ONCE = RetryPolicy(attempts=1, initial_delay=timedelta(0), max_delay=timedelta(0))
QUICK = MemoryConfig(batch_size=1, retry_delay=timedelta(0), max_retry_delay=timedelta(0))
CARD = "4111111111111111"


def published(db: Any, broker: MemoryBroker, bodies: list[bytes], otel: Otel) -> None:
    tracer = otel.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("request"), Session(db.engine) as session, session.begin():
        for body in bodies:
            Outbox(tables=db.tables).add(session, "orders", body)
    with OutboxRelay(db.engine, broker, tables=db.tables) as relay:
        assert relay.drain() == len(bodies)


def test_a_retry_that_recovers_links_its_attempts(sqlite_db: Any, otel: Otel) -> None:
    broker = MemoryBroker()
    published(sqlite_db, broker, [b"{}"], otel)
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables, retry=ONCE)
    tries: list[int] = []

    @dedup.handler
    def flaky(message: Message, session: Session) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise RetryLater("downstream busy")

    MemoryConsumerRunner(flaky, "orders", broker=broker, config=QUICK).run(until_idle=True)
    first, second = otel.named("process orders")
    (send,) = otel.named("send orders")
    assert dict(first.attributes or {})["consumerdedup.outcome"] == "retry"
    assert dict(first.attributes or {})["error.type"] == "RetryLater"
    assert dict(second.attributes or {})["consumerdedup.outcome"] == "processed"
    for attempt in (first, second):  # each a child of the producer's span
        assert attempt.parent is not None and attempt.parent.span_id == send.context.span_id
        assert dict(attempt.attributes or {})["messaging.system"] == "memory"
    assert [link.context.span_id for link in second.links] == [first.context.span_id]


def test_a_failed_message_records_its_error_without_its_values(sqlite_db: Any, otel: Otel) -> None:
    broker = MemoryBroker()
    published(sqlite_db, broker, [b"{}"], otel)
    with sqlite_db.engine.begin() as conn:
        conn.execute(text("CREATE TABLE cards (number TEXT UNIQUE)"))
        conn.execute(text("INSERT INTO cards VALUES (:card)"), {"card": CARD})
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables, retry=ONCE)

    @dedup.handler
    def refuse(message: Message, session: Session) -> None:
        session.execute(text("INSERT INTO cards VALUES (:card)"), {"card": CARD})

    MemoryConsumerRunner(refuse, "orders", broker=broker, config=QUICK).run(until_idle=True)
    (span,) = otel.named("process orders")
    attributes = dict(span.attributes or {})
    assert attributes["consumerdedup.outcome"] == "failed"
    assert attributes["error.type"] == "IntegrityError"
    assert span.status.status_code is StatusCode.ERROR
    (event,) = [e for e in span.events if e.name == "exception"]
    stack = str(dict(event.attributes or {})["exception.stacktrace"])
    assert "in refuse" in stack and "UNIQUE constraint failed: cards.number" in stack
    everything = repr([span.attributes, span.status.description, span.events])
    assert CARD not in everything and "[parameters" not in everything


def test_a_batch_span_counts_links_and_parents_one_span_per_message(
    sqlite_db: Any, otel: Otel
) -> None:
    broker = MemoryBroker()
    published(sqlite_db, broker, [b"1", b"2", b"3"], otel)
    dedup = Deduplicator(sqlite_db.engine, consumer="c", tables=sqlite_db.tables)
    handler = dedup.handler(lambda message, session: None)
    config = MemoryConfig(batch_size=10)
    MemoryConsumerRunner(handler, "orders", broker=broker, config=config).run(until_idle=True)
    spans = otel.named("process orders")
    [batch] = [s for s in spans if "messaging.batch.message_count" in (s.attributes or {})]
    assert dict(batch.attributes or {})["messaging.batch.message_count"] == 3
    assert batch.kind is SpanKind.CONSUMER and len(batch.links) == 3
    sends = {s.context.span_id for s in otel.named("send orders")}
    assert {link.context.span_id for link in batch.links} == sends
    children = [s for s in spans if s is not batch]
    assert len(children) == 3
    assert all(c.parent is not None and c.parent.span_id == batch.context.span_id for c in children)
    assert {dict(c.attributes or {})["consumerdedup.outcome"] for c in children} == {"processed"}


def test_without_an_sdk_set_up_the_hooks_do_nothing() -> None:
    from opentelemetry import trace

    from consumerdedup import telemetry
    from consumerdedup.telemetry import hooks
    from consumerdedup.telemetry.tracing import IDLE

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # another test of this process set a global SDK: nothing to show here
    telemetry.instrument()
    try:
        assert hooks.process is not None
        assert hooks.process.start("c", [Message("m", b"")]) is IDLE
    finally:
        telemetry.uninstrument()


def test_the_replaced_names_too_when_opted_in(monkeypatch: Any) -> None:
    from consumerdedup.telemetry import attributes

    message = Message("m", b"", source="orders")
    assert "messaging.operation" not in attributes.consumer_attributes(message, "c")
    monkeypatch.setattr(attributes, "_DUP", True)  # OTEL_SEMCONV_STABILITY_OPT_IN=messaging/dup
    both = attributes.consumer_attributes(message, "c")
    assert (
        both["messaging.operation"] == "process" and both["messaging.operation.name"] == "process"
    )
