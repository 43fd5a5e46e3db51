"""``consumerdedup.faststream``: a FastStream broker middleware that runs each message once.

In FastStream 0.7 the acknowledgement middleware is the outermost layer and a broker
middleware's ``consume_scope`` wraps the handler's dependency resolution. So, per message,
``consume_scope`` hands the delivery to the runners' own pipeline (``process_once``: the
same claim, guard, retries, FAILED records, dead-letter callback, breaker and telemetry);
the pipeline's handler puts the transaction's session in FastStream's context (where
``Context("session")`` finds it), calls FastStream's handler, and the pipeline COMMITs the
handler's writes with the message's record; only then does FastStream ack. The Outcome
becomes FastStream's acknowledgement:

* PROCESSED: the handler's return value goes back to FastStream (its reply and
  ``@publisher`` outputs are published after the COMMIT, outside the transaction: use the
  Outbox in the handler to publish exactly once), then FastStream acks;
* DUPLICATE: ``AckMessage``: acked, the handler not called, nothing published;
* the handler's own ``raise AckMessage()``: its writes commit with the record (PROCESSED),
  then acked with no reply; ``raise NackMessage()``: RETRY (its writes rolled back, nothing
  recorded, its NackMessage passed on); ``raise RejectMessage()``: FAILED at once; its
  ``await message.ack()``/``nack()``/``reject()`` is held until it returns, then the same
  (an ack before the COMMIT would lose a message whose transaction then fails);
* RETRY (a transient failure past the in-process attempts, nothing recorded):
  ``NackMessage``: the broker delivers it again (RabbitMQ requeue, Kafka seek back,
  NATS nak);
* FAILED (recorded, the Deduplicator's ``dead_letter`` called): ``RejectMessage`` under
  ``REJECT_ON_ERROR`` and ``NACK_ON_ERROR`` (RabbitMQ's dead-letter exchange, NATS
  ``term()``; a nack would only bring back a DUPLICATE), ``AckMessage`` under ``ACK`` and
  on Redis (whose reject leaves a stream entry pending, to come back as a DUPLICATE).

Refused: ``ACK_FIRST`` (acked before the handler ran, RabbitMQ ``no_ack``, Kafka's
auto-commit default) and ``MANUAL`` (FastStream acks nothing; the handler would ack
before the COMMIT), and a database whose tables the startup check refuses. With no user
code, on the first delivery through the middleware (FastStream 0.7 calls a broker
middleware on nothing but a delivery or a publish: no broker or subscriber start hook
reaches it): the subscriber's policy, every other subscriber of the FastStream app's
broker that the middleware applies to, and the tables are checked; a refusal is logged
CRITICAL, the message is nacked (not recorded, not dead-lettered: a setup fault is never a
message's failure), every later delivery too, and the consumer stops: the FastStream app
exits (``app.exit()``), or, with no app, the subscriber stops. What ``ACK_FIRST`` acked on
receipt before that first call is gone: ``await once.check(broker)`` in the app's
``on_startup`` refuses before anything is consumed.

Opt-in per subscriber: 0.7's ``subscriber()`` takes no ``middlewares=``, so the
middleware goes on a router (``RabbitRouter(middlewares=[once])``) holding the
deduplicated subscribers, or on the broker for all of them.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from faststream import BaseMiddleware
from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from faststream.middlewares import AckPolicy
from sqlalchemy.ext.asyncio import AsyncSession

from ..dedup.async_deduplicator import AsyncDeduplicator
from ..dedup.processing import AsyncProcessor
from ..errors import CircuitOpen, ConfigurationError, PermanentError, RetryLater
from ..headers import ID_HEADER
from ..message import Message
from ..observe import logger
from ..options import function, instance, maybe, text
from ..outcome import Outcome, Result
from ..reasons import describe
from .faststream_dead_letters import check_broker, publish_dead_letter
from .faststream_ids import KeyFunction, broker_of, delivered

__all__ = ["SESSION", "DedupMiddleware"]

SESSION = "session"
"""The context name the session has in the handler: ``session = Context("session")``."""

_REFUSED = {
    AckPolicy.ACK_FIRST: "acks before the handler runs (RabbitMQ consumes with no_ack, "
    "Kafka auto-commits), so a crash loses the message",
    AckPolicy.MANUAL: "leaves the ack to the handler, which runs before the COMMIT (a NATS "
    "JetStream push subscriber given ACK_FIRST reports MANUAL: its client acks on receipt; so "
    "does a Redis list, channel or stream without a group, which has no ack at all: a message "
    "read is gone; use StreamSub(stream, group=...))",
}
_FIX = (
    "subscribe with ack_policy=AckPolicy.REJECT_ON_ERROR (a dead-letter on a permanent "
    "failure), NACK_ON_ERROR or ACK"
)


@dataclass(slots=True)
class _Call:
    """One delivery's way back into FastStream, for the pipeline's handler."""

    call_next: Callable[[Any], Awaitable[Any]]
    stream_message: Any
    context: Any
    returned: Any = None
    acked: AckMessage | None = None
    """The handler's own ``raise AckMessage``: done, its writes commit, then FastStream acks."""


class NackedByHandler(RetryLater):
    """The handler raised FastStream's ``NackMessage``: RETRY (rolled back, nothing recorded),
    then the handler's own NackMessage goes to FastStream (its options kept)."""

    def __init__(self, nack: NackMessage) -> None:
        super().__init__("the handler raised NackMessage: delivered again")
        self.nack = nack


class RejectedByHandler(PermanentError):
    """The handler raised FastStream's ``RejectMessage``: FAILED at once (recorded,
    dead-lettered), acknowledged as every FAILED message is under the subscriber's policy."""

    def __init__(self) -> None:
        super().__init__("the handler raised RejectMessage")


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("consumerdedup_faststream_call")


class DedupMiddleware:
    """A FastStream broker middleware over an AsyncDeduplicator: one per consumer.

    ``key``: the id of a delivery whose broker carries none (faststream_ids); ``id_header``:
    the header an id is read from (``event_id``, what the outbox sets); ``dead_letters``:
    a FastStream Kafka or RabbitMQ broker to publish each FAILED message's dead letter
    through, before the ack (faststream_dead_letters), for ``consumerdedup failed replay``.
    """

    def __init__(
        self,
        dedup: AsyncDeduplicator,
        *,
        key: KeyFunction | None = None,
        id_header: str = ID_HEADER,
        dead_letters: Any = None,
    ) -> None:
        instance(
            dedup,
            "DedupMiddleware.dedup",
            AsyncDeduplicator,
            "an AsyncDeduplicator (FastStream runs on asyncio; a blocking Deduplicator's "
            "session would block its event loop)",
        )
        self.key = maybe(key, "DedupMiddleware.key", function, "a function of a Message")
        self.id_header = text(id_header, "DedupMiddleware.id_header")
        self.dead_letters = dead_letters
        self._dead_letter_kind = None if dead_letters is None else check_broker(dead_letters)
        self.dedup = dedup
        # claim_first: a twin delivery in this process waits on the claim's row, then
        # answers DUPLICATE (with no prefetch FastStream runs both at once).
        # The runners' entry (process_once's too; it takes no refusal reason, which a
        # delivery without an id carries to its FAILED record and dead letter).
        self.processor = AsyncProcessor(dedup.handler(claim_first=True)(_call_faststream))
        self.refused: ConfigurationError | None = None
        """The setup fault found on a first delivery: every delivery is nacked after it."""
        self._passed: set[int] = set()  # ids of the subscribers whose first delivery passed
        self._stopping: set[asyncio.Task[None]] = set()

    def __call__(self, msg: Any, /, *, context: Any) -> _DedupScope:
        """FastStream's middleware factory: one scope per delivery."""
        return _DedupScope(msg, context=context, owner=self)

    async def check(self, subscribers: Any) -> None:
        """At start (``@app.on_startup``, or before ``broker.start()``): refuse a subscriber
        of ``subscribers`` (a broker or a router: every one it holds; or an iterable of
        them) whose ack policy is refused, and check the database's tables
        (ConfigurationError)."""
        held = getattr(subscribers, "subscribers", subscribers)
        for subscriber in held if isinstance(held, Iterable) else [held]:
            if self._applies_to(subscriber):
                refuse_policy(subscriber)
        await self.processor.check_startup()

    async def first_delivery(self, subscriber: Any, context: Any) -> None:
        """Before a subscriber's first delivery is decided: ``check`` of the subscriber and
        of the app's broker (when run by a FastStream app); a refusal halts the consumer
        (see the module) and nacks the delivery."""
        if self.refused is None and id(subscriber) in self._passed:
            return
        if self.refused is None:
            app = context.get("app")
            broker = getattr(app, "broker", None)
            try:
                refuse_policy(subscriber)
                await self.check(broker if broker is not None else [subscriber])
            except ConfigurationError as exc:
                self.refused = exc
                logger.critical("consumerdedup.faststream stops consuming: %s", exc)
                self._halt(subscriber, app)
            else:
                self._passed.add(id(subscriber))
                return
        raise NackMessage from self.refused

    async def dead_letter(self, result: Result) -> None:
        """A FAILED message's dead letter through ``dead_letters``, if given; a failed
        publish nacks the message (it comes back to its FAILED record, and is sent then)."""
        if self._dead_letter_kind is None:
            return
        try:
            await publish_dead_letter(
                self.dead_letters, self._dead_letter_kind, self.processor.consumer, result
            )
        except Exception as exc:
            logger.error(
                "%s: the dead letter of %r was not published (%s); message nacked",
                self.processor.consumer,
                result.message.id,
                describe(exc),
            )
            raise NackMessage from exc

    def _halt(self, subscriber: Any, app: Any) -> None:
        if app is not None and hasattr(app, "exit"):
            app.exit()
            return
        task = asyncio.get_running_loop().create_task(subscriber.stop())
        self._stopping.add(task)  # held until done: a task only weakly referenced may vanish
        task.add_done_callback(self._stopping.discard)

    def _applies_to(self, subscriber: Any) -> bool:
        """Whether this middleware is in the subscriber's chain (on its router or broker).
        FastStream 0.7 keeps the chain in a private property: without it, every subscriber
        given is taken as one of ours (refused rather than let through)."""
        chain = getattr(subscriber, "_broker_middlewares", None)
        return chain is None or any(m is self for m in chain)


def refuse_policy(subscriber: Any) -> None:
    """ConfigurationError for a subscriber whose ack policy the dedup cannot work under."""
    policy = subscriber.ack_policy
    if policy in _REFUSED:
        name = subscriber.specification.call_name
        raise ConfigurationError(
            f"FastStream subscriber {name!r}: ack_policy {policy.name} {_REFUSED[policy]}; "
            f"consumerdedup.faststream expected another: {_FIX}"
        )


class _DedupScope(BaseMiddleware):
    """One delivery through the pipeline, inside FastStream's acknowledgement."""

    def __init__(self, msg: Any, /, *, context: Any, owner: DedupMiddleware) -> None:
        super().__init__(msg, context=context)
        self.owner = owner

    async def consume_scope(self, call_next: Any, msg: Any) -> Any:
        owner = self.owner
        subscriber = self.context.get("handler_")
        await owner.first_delivery(subscriber, self.context)
        message, why = delivered(msg, owner.id_header, owner.key)
        call = _Call(call_next, msg, self.context)
        token = _CALL.set(call)
        processor = owner.processor
        try:
            processor.breaker.raise_if_open()
            [result] = await processor.process([(message, why)])
        except CircuitOpen as exc:  # a broken deploy: nothing is tried, nothing recorded
            logger.error("%s: %s; message nacked, not tried", processor.consumer, exc)
            raise NackMessage from exc
        finally:
            _CALL.reset(token)
        if result.outcome is Outcome.PROCESSED:
            if call.acked is not None:
                raise call.acked  # committed; FastStream acks (and publishes no reply)
            return call.returned
        if result.outcome is Outcome.DUPLICATE:
            raise AckMessage
        if result.outcome is Outcome.RETRY:
            if isinstance(result.error, NackedByHandler):
                raise result.error.nack
            raise NackMessage
        await owner.dead_letter(result)
        if subscriber.ack_policy is AckPolicy.ACK or broker_of(msg) == "redis":
            raise AckMessage  # Redis: a rejected stream entry stays pending, to come back
        raise RejectMessage


async def _call_faststream(message: Message, session: AsyncSession) -> None:
    """The pipeline's handler: FastStream's own (dependencies resolved, decoded body) with
    the transaction's session in its context; its return value kept for FastStream."""
    call = _CALL.get()
    with call.context.scope(SESSION, session):
        # FastStream's own acknowledgement exceptions are the handler's decision, not an
        # error of it: AckMessage is done (commit), NackMessage is RETRY, RejectMessage FAILED
        # The message's own ack()/nack()/reject(), called by the handler, would settle it
        # before the COMMIT (an ack then a failure: gone, nothing recorded): held until the
        # handler returns, then taken as the same exception would be.
        settled: list[str] = []
        held = _hold_settling(call.stream_message, settled)
        try:
            call.returned = await call.call_next(call.stream_message)
        except AckMessage as done:
            call.acked = done
        except NackMessage as nack:
            raise NackedByHandler(nack) from None
        except RejectMessage:
            raise RejectedByHandler() from None
        finally:
            for name in held:
                delattr(call.stream_message, name)
        if settled == ["ack"]:
            call.acked = AckMessage()
        elif settled == ["nack"]:
            raise NackedByHandler(NackMessage())
        elif settled == ["reject"]:
            raise RejectedByHandler()


_SETTLING = ("ack", "nack", "reject")


def _hold_settling(stream_message: Any, settled: list[str]) -> list[str]:
    """Replace the message's ``ack``/``nack``/``reject`` for the handler's call by ones that
    note the first call in ``settled`` (FastStream settles a message once); the names put
    on the instance, to delete after the call (the class's own methods then show again)."""
    held = []
    for name in _SETTLING:
        if name in vars(stream_message):
            continue  # already an instance attribute: not ours to replace

        async def note(*_: Any, _name: str = name, **__: Any) -> None:
            if not settled:
                settled.append(_name)

        setattr(stream_message, name, note)
        held.append(name)
    return held
