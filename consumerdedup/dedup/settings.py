"""What the blocking and asyncio deduplicators share: settings, retries, bookkeeping."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import tenacity

from ..errors import ConfigurationError, InvalidMessage, PermanentError
from ..message import validate_id
from ..observe import OutcomeCounts, log_result, logger
from ..outcome import Outcome, Result
from ..reasons import describe
from ..retry import RetryPolicy
from ..schema import DEFAULT, Tables
from .ops import AttemptReport
from .pipeline import Pipeline
from .statements import Statements

Observer = Callable[[Result], None]


class DeadLetterFailed(PermanentError):
    """The dead-letter callback raised: the message is left for redelivery instead of acked."""


class DeduplicatorSettings:
    """Consumer name, tables, retry policy and the hooks told about every outcome."""

    def __init__(
        self,
        dialect: str,
        consumer: str,
        *,
        tables: Tables = DEFAULT,
        retry: RetryPolicy | None = None,
        dead_letter: Callable[[Result], Any] | None = None,
        observers: Iterable[Observer] = (),
    ) -> None:
        try:
            validate_id(consumer)
        except InvalidMessage as exc:
            # Stored beside every message id: a name the table cannot hold fails every message.
            raise ConfigurationError(f"consumer name {consumer!r:.80} is unusable: {exc}") from None
        self.consumer = consumer
        self.tables = tables
        self.retry = retry if retry is not None else RetryPolicy()
        self.dead_letter = dead_letter
        self.observers = tuple(observers)
        self.counts = OutcomeCounts()
        self._statements = Statements(tables, dialect)
        self._backoff = self.retry.backoff()

    def pipeline(self, claim_first: bool) -> Pipeline:
        return Pipeline(self._statements, self.consumer, self.retry, claim_first)

    @staticmethod
    def replay(first: AttemptReport) -> Iterator[AttemptReport]:
        """Hand tenacity the first attempt's report as its attempt 1, so its wait applies.

        The first attempt runs outside tenacity, which costs a measurable share
        of a one-message transaction; only a batch with undecided items enters it.
        """
        return iter([first])

    def retrying_options(self) -> dict[str, Any]:
        """Keep attempting while items are undecided; the pipeline bounds the attempts."""
        return {
            "stop": tenacity.stop_never,
            "wait": self._wait,
            "retry": tenacity.retry_if_result(lambda report: report.pending),
            "reraise": True,
        }

    def _wait(self, state: tenacity.RetryCallState) -> float:
        assert state.outcome is not None
        report: AttemptReport = state.outcome.result()
        return float(self._backoff(state)) if report.backoff else 0.0

    def dead_letter_failed(self, result: Result, exc: Exception) -> Result:
        error = DeadLetterFailed(
            f"dead-letter callback raised {describe(exc)} for: {result.reason}"
        )
        error.__cause__ = exc
        return Result(result.message, Outcome.RETRY, error, result.attempts)

    def account(self, result: Result) -> None:
        self.counts.add(result.outcome)
        log_result(self.consumer, result)
        for observer in self.observers:
            try:
                observer(result)
            except Exception:
                # A broken metrics hook must not stop the consumer or block its acks.
                logger.exception("observer %r raised; the message's outcome stands", observer)
