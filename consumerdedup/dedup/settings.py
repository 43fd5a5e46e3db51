"""What both deduplicators are besides their engine: a consumer's settings and its reporting.

The retry loop is not here: the pipeline decides each next attempt and its wait
(``AttemptReport``), and each deduplicator runs that loop in a few plain lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from ..errors import ConfigurationError, InvalidMessage, PermanentError
from ..message import MAX_ID_LENGTH, validate_id
from ..observe import OutcomeCounts, log_result, log_results, logger
from ..options import boolean, function, functions, instance, maybe, text
from ..outcome import Outcome, Result
from ..reasons import describe
from ..retry import RetryPolicy
from ..schema import DEFAULT, Tables
from .bulk import BulkPipeline
from .pipeline import Pipeline
from .statements import Statements

Observer = Callable[[Result], None]
T = TypeVar("T")


class DeadLetterFailed(PermanentError):
    """The dead-letter callback raised: the message is left for redelivery instead of acked."""


class OutcomeReporter:
    """A consumer's name, tables and retry policy; the pipelines it runs; and the report of
    every final Result: to the dead-letter hook (FAILED), the counters, the log and the
    observers. The base of Deduplicator and AsyncDeduplicator, which add the engine."""

    def __init__(
        self,
        dialect: str,
        consumer: str,
        *,
        tables: Tables = DEFAULT,
        retry: RetryPolicy | None = None,
        dead_letter: Callable[[Result], Any] | None = None,
        observers: Iterable[Observer] = (),
        owner: str = "Deduplicator",
    ) -> None:
        """Both deduplicators' options, checked here once (``owner`` names the class)."""
        self.owner = owner
        text(consumer, f"{owner}.consumer", max_length=MAX_ID_LENGTH)
        try:
            validate_id(consumer)
        except InvalidMessage as exc:
            # Stored beside every message id: a name the table cannot hold fails every message.
            raise ConfigurationError(f"consumer name {consumer!r:.80} is unusable: {exc}") from None
        self.consumer = consumer
        self.tables = instance(tables, f"{owner}.tables", Tables, "a Tables (Tables.define(...))")
        given = maybe(retry, f"{owner}.retry", instance, RetryPolicy, "a RetryPolicy or None")
        self.retry: RetryPolicy = given if given is not None else RetryPolicy()
        # Called without await by the blocking Deduplicator: an async def would never send.
        sync = not owner.startswith("Async")
        self.dead_letter = maybe(dead_letter, f"{owner}.dead_letter", function, blocking=sync)
        self.observers: tuple[Observer, ...] = functions(
            observers, f"{owner}.observers", "a callable taking a Result"
        )
        self.counts = OutcomeCounts()
        self._statements = Statements(self.tables, dialect)

    def _claim_first(self, claim_first: object) -> bool:
        """``handler(claim_first=...)``, checked for both deduplicators."""
        return boolean(claim_first, f"{self.owner}.handler(claim_first)")

    def _session_factory(self, session_factory: T) -> T:
        maybe(session_factory, f"{self.owner}.session_factory", function)
        return session_factory

    def _pipeline(self, claim_first: bool) -> Pipeline:
        return Pipeline(self._statements, self.consumer, self.retry, claim_first)

    def _bulk_pipeline(self) -> BulkPipeline:
        return BulkPipeline(self._statements, self.consumer, self.retry)

    def _dead_letter_failed(self, result: Result, exc: Exception) -> Result:
        """The dead-letter hook raised for ``result``: RETRY instead, so it is not acked."""
        error = DeadLetterFailed(
            f"dead-letter callback raised {describe(exc)} for: {result.reason}"
        )
        error.__cause__ = exc
        return Result(result.message, Outcome.RETRY, error, result.attempts)

    def _account_all(self, results: Sequence[Result]) -> None:
        """``_account`` of each result, in order; without observers, the counts in one
        step and only the lines logged at their levels looked at one by one."""
        if self.observers:
            for result in results:
                self._account(result)
            return
        self.counts.add_all([result.outcome for result in results])
        log_results(self.consumer, results)

    def _account(self, result: Result) -> None:
        self.counts.add(result.outcome)
        log_result(self.consumer, result)
        for observer in self.observers:
            try:
                observer(result)
            except Exception:
                # A broken metrics hook must not stop the consumer or block its acks.
                logger.exception("observer %r raised; the message's outcome stands", observer)
