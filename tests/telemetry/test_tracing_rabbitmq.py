"""One trace from the request that wrote an event to the consumer that applied it,
through the real RabbitMQ and a second hop, read back from the SDK's in-memory exporter."""

from __future__ import annotations

from typing import Any

from opentelemetry import baggage, context
from opentelemetry.trace import SpanKind
from sqlalchemy.orm import Session

from consumerdedup import Deduplicator, Message, Outbox, OutboxRelay
from consumerdedup.adapters.rabbitmq import RabbitConsumerRunner, RabbitPublisher
from tests.support.rabbitmq_service import Broker, amqp_url_fixture, rabbit_fixture  # noqa: F401
from tests.telemetry.conftest import Otel, assert_two_hops


def test_one_event_through_rabbitmq_and_a_second_hop_is_one_trace(
    sqlite_db: Any, rabbit: Broker, otel: Otel
) -> None:
    db, outbox = sqlite_db, Outbox(tables=sqlite_db.tables)
    orders, billing = rabbit.queue("orders"), rabbit.queue("billing")
    tracer = otel.tracer_provider.get_tracer("test")
    token = context.attach(baggage.set_baggage("tenant", "t-1"))
    try:
        request = tracer.start_as_current_span("POST /orders")
        with request, Session(db.engine) as session, session.begin():
            outbox.add(session, orders, b'{"order": 1}')
    finally:
        context.detach(token)
    seen: list[Message] = []
    orders_dedup = Deduplicator(db.engine, consumer="orders", tables=db.tables)
    billing_dedup = Deduplicator(db.engine, consumer="billing", tables=db.tables)

    @orders_dedup.handler
    def take_order(message: Message, session: Session) -> None:
        seen.append(message)
        outbox.add(session, billing, b'{"bill": 1}')

    @billing_dedup.handler
    def bill(message: Message, session: Session) -> None:
        seen.append(message)

    with OutboxRelay(db.engine, RabbitPublisher(rabbit.url), tables=db.tables) as relay:
        assert relay.drain() == 1
        RabbitConsumerRunner(take_order, orders, url=rabbit.url).run(until_idle=True)
        assert relay.drain() == 1
        RabbitConsumerRunner(bill, billing, url=rabbit.url).run(until_idle=True)

    assert_two_hops(otel, orders, billing)
    rounds = otel.named("send")  # the relay's own: one per window, each send links to it
    assert len(rounds) == 2 and all(r.kind is SpanKind.CLIENT for r in rounds)
    sends = otel.named(f"send {orders}") + otel.named(f"send {billing}")
    assert [s.links[0].context.span_id for s in sends] == [r.context.span_id for r in rounds]
    assert seen[0].headers["baggage"] == "tenant=t-1"  # baggage travels with the event
    assert "traceparent" in seen[1].headers
    (process,) = otel.named(f"process {orders}")
    attributes = dict(process.attributes or {})
    assert process.kind is SpanKind.CONSUMER
    assert attributes["messaging.system"] == "rabbitmq"
    assert attributes["messaging.operation.name"] == "process"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.destination.name"] == orders
    assert attributes["messaging.message.id"] == seen[0].id
    assert attributes["messaging.consumer.group.name"] == "orders"
    assert attributes["consumerdedup.consumer"] == "orders"
    assert isinstance(attributes["messaging.rabbitmq.message.delivery_tag"], int)
    (send,) = otel.named(f"send {orders}")
    assert dict(send.attributes or {})["messaging.message.id"] == seen[0].id
    assert dict(send.attributes or {})["messaging.operation.type"] == "send"
    consumed = otel.points("messaging.client.consumed.messages")
    outcomes = {
        (
            p.attributes["messaging.consumer.group.name"],
            p.attributes["consumerdedup.outcome"],
        ): p.value
        for p in consumed
    }
    assert outcomes == {("orders", "processed"): 1, ("billing", "processed"): 1}
    (duration, *_) = otel.points("messaging.process.duration")
    assert duration.count == 1 and list(duration.explicit_bounds)[:3] == [0.005, 0.01, 0.025]
    sent = otel.points("messaging.client.sent.messages")
    assert sum(p.value for p in sent) == 2
    assert otel.points("messaging.client.operation.duration")
