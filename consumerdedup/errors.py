"""The error tree: one root, failures apart from control flow.

Every class here, drawn by what it derives from::

    Exception
     +-- ConsumerDedupError ........ root of every error raised on purpose
          +-- ConfigurationError ... a setting is wrong (also a ValueError); before any message
          |    +-- AuthenticationFailed  a broker or database refused the credentials: fatal
          +-- PermanentError ....... the message ends FAILED: recorded and dead-lettered
          |    +-- InvalidMessage .. no valid id, or a malformed delivery
          |    +-- DecodeError ..... the body cannot be decoded
          |    +-- PayloadMismatch . the id was processed before with another payload
          |    +-- RecordedFailure . a redelivery of a message that FAILED before
          |    +-- CommitInHandler . the handler called session.commit()
          +-- RetryLater ........... control flow: roll back, deliver again, record nothing
          |    +-- HeldBack ........ ordered: not tried, a message ahead will come again
          +-- TransactionBroken .... the handler broke our transaction; classified by its cause
          +-- BatchMessageFailed ... a bulk handler names the message that failed, and why
          +-- CircuitOpen .......... the breaker stopped a runner: messages in a row failed alike
          +-- BrokerUnavailable .... cannot reach the broker (also a ConnectionError)
          +-- DestinationMissing ... the broker says the destination does not exist
    BaseException
     +-- SimulatedCrash ............ the test broker killing a consumer between commit and ack

The parts add leaves beside their code: ``HandlerNotRun`` (a
ConfigurationError) and ``DeadLetterFailed`` (a PermanentError) in
``consumerdedup.dedup``, ``UnknownConsumer`` and ``RetentionUnknown`` in
``consumerdedup.prune``, the HTTP errors in ``consumerdedup.http``, and each
adapter's ``errors`` module (its own BrokerUnavailable and DestinationMissing
subclasses, ``BrokerRefused``, a ConfigurationError, and ``AuthenticationFailed``
under both).

How a failure becomes text (for logs, the error column and dead-letter
headers) is ``consumerdedup.reasons``; this module imports nothing.
"""

from __future__ import annotations


class ConsumerDedupError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigurationError(ConsumerDedupError, ValueError):
    """A setting is invalid: caught at construction, before any message flows."""


class AuthenticationFailed(ConfigurationError):
    """The broker or the database answered and refused the credentials (RabbitMQ
    ACCESS_REFUSED, a Kafka SASL failure, PostgreSQL's "password authentication failed"):
    fatal for the relay and the runners alike, never a BrokerUnavailable retried forever."""


class PermanentError(ConsumerDedupError):
    """The message can never succeed: record it as FAILED and dead-letter it.

    Raise it (or a subclass) from a handler to refuse a message for good.
    """

    @property
    def reason(self) -> str:
        return str(self) or type(self).__name__


class InvalidMessage(PermanentError):
    """The message itself is unusable: no valid id, or a malformed delivery."""


class DecodeError(PermanentError):
    """The body cannot be decoded into what the handler expects."""


class PayloadMismatch(PermanentError):
    """The id was processed before with a different payload: a reused id, never dropped silently."""

    def __init__(self, message_id: str, recorded_hash: str, received_hash: str) -> None:
        super().__init__(
            f"message id {message_id!r} was processed before with a different payload "
            f"(recorded sha256 {recorded_hash[:12]}..., received {received_hash[:12]}...)"
        )
        self.message_id = message_id
        self.recorded_hash = recorded_hash
        self.received_hash = received_hash


class RecordedFailure(PermanentError):
    """A redelivery of a message that FAILED before: dead-lettered again with the first reason."""


class RetryLater(ConsumerDedupError):
    """Control flow, not a failure: roll back and deliver the message again later."""


class TransactionBroken(ConsumerDedupError):
    """The handler left the pipeline's transaction unusable, so its writes cannot commit.

    It caught a database error and went on (PostgreSQL then answers COMMIT with
    ROLLBACK, silently), or it ended the transaction itself. ``cause`` is the
    swallowed error when it is known; the retry policy classifies by it.
    """

    def __init__(self, text: str, cause: BaseException | None = None) -> None:
        super().__init__(text)
        self.cause = cause


class BatchMessageFailed(ConsumerDedupError):
    """Raised by a bulk handler to name the message that failed (like Spring Kafka's
    ``BatchListenerFailedException``): only it fails, by ``cause``'s kind, with no bisection.

    ``message`` is the Message itself, its id, or its index in the list the handler was
    given. A message the batch does not hold names nothing: the batch is bisected.
    """

    def __init__(self, message: object, cause: BaseException | None = None) -> None:
        where = (
            f"index {message}"
            if isinstance(message, int)
            else repr(getattr(message, "id", message))
        )
        super().__init__(f"bulk handler failed at {where}" + (f": {cause!r:.200}" if cause else ""))
        self.message = message
        self.cause = cause
        self.__cause__ = cause


class CommitInHandler(PermanentError):
    """A handler called ``session.commit()``: refused, or its writes would commit
    without their dedup record."""


class HeldBack(RetryLater):
    """On an ordered source: not tried, because a message ahead of it will be delivered again."""


class CircuitOpen(ConsumerDedupError):
    """The circuit breaker is open: so many messages in a row failed for good with the same
    exception type that the runner stopped taking messages (a broken deploy, not bad data).

    A runner's ``run()`` ends with it; the messages of its last batch that were not tried
    end RETRY with it as their reason (not acked: the broker keeps them).
    """


class BrokerUnavailable(ConsumerDedupError, ConnectionError):
    """The broker cannot be reached or did not answer in time: transient, charged to no event.

    Each adapter raises its own subclass; the outbox relay ends its round and backs off.
    """


class DestinationMissing(ConsumerDedupError):
    """The broker answered: this destination does not exist (and it does not create it).

    Not a BrokerUnavailable even when the client library calls it retriable:
    one event's topic must not stop the events of every other key.
    """


class SimulatedCrash(BaseException):
    """Raised by the test broker to kill a consumer between commit and ack.

    A BaseException so that handlers' and runners' ``except Exception`` blocks
    cannot swallow it, exactly as they could not swallow a real process death.
    """
