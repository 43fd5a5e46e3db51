"""``IdempotentTask``: a Celery task whose body and its processed_events record commit in
one transaction, through the pipeline every runner uses (``process_once``).

``@app.task(base=IdempotentTask, bind=True, engine=engine)``; the body reads
``self.session`` and writes on it. Task options (Celery passes ``@app.task``'s extra
keywords to the task class): ``engine`` (a blocking SQLAlchemy Engine, required),
``key`` (a function of the task's arguments returning the dedup key; default the task
id), ``consumer`` (the record's consumer; default the task's name), ``tables``.

What each outcome does in Celery:

* PROCESSED: the body's return value is the task's result.
* DUPLICATE (the key was processed before): the body does not run; logged at INFO, the
  state meta says so while it runs, and the result is the one the result backend holds
  for the task id (None if it holds none).
* RETRY (a transient error: ``RetryLater``, a lost connection, a deadlock): nothing is
  recorded and ``self.retry()`` sends the task again with Celery's countdown
  (``default_retry_delay``) under the same task id; on the last attempt
  (``request.retries >= max_retries``) the body's error is permanent instead.
* FAILED (any other error of the body, a ``PermanentError``): recorded FAILED, its dead
  letter (the task message) published to ``<queue>.dlq`` on the task's broker
  (celery_dead_letters.py), then raised, so Celery marks the task failed;
  ``consumerdedup failed list`` shows it, and after a fix ``consumerdedup failed replay
  --celery-app module:app --queue <queue>`` (or ``task.replay(task_id)``) sends it again.
  If the dead letter cannot be published, the task is rejected with requeue (not acked):
  it comes back, answers its FAILED record again and is dead-lettered then.

The worker refuses to start on settings under which a task can be lost or run by two
workers at once (celery_settings.py). The Deduplicator's own in-process attempts are
one: Celery's retry is the retry, and the circuit breaker is off (a Celery worker has
no consumer to stop; each task fails alone).
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

from celery import Task, bootsteps  # type: ignore[import-untyped]
from celery.exceptions import (  # type: ignore[import-untyped]
    Ignore,
    MaxRetriesExceededError,
    Reject,
    Retry,
)
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from ..dedup.deduplicator import DedupHandler, Deduplicator
from ..dedup.processing import BlockingProcessor, Delivered
from ..dedup.settings import DeadLetterFailed
from ..errors import ConfigurationError, InvalidMessage, PermanentError, RetryLater
from ..failed import forget
from ..message import Message
from ..options import function, instance, maybe, text
from ..outcome import Outcome, Result
from ..retry import RetryPolicy
from ..schema import DEFAULT, Tables
from .celery_dead_letters import send_dead_letter
from .celery_settings import refuse_unsafe

__all__ = ["IdempotentTask"]

logger = logging.getLogger("consumerdedup.celery")

DUPLICATE_RESULT_WAIT = 5.0
"""Seconds a DUPLICATE under its first run's task id waits for that run's stored result."""
_ONE_ATTEMPT = RetryPolicy(attempts=1, breaker_threshold=None)
_session: contextvars.ContextVar[Session] = contextvars.ContextVar("consumerdedup_celery_session")
_call: contextvars.ContextVar[_Call] = contextvars.ContextVar("consumerdedup_celery_call")


class _Call:
    """One run of a task body: its arguments, whether it is the last attempt, its result."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], last: bool) -> None:
        self.args, self.kwargs, self.last = args, kwargs, last
        self.returned: Any = None
        self.ignored: Ignore | None = None
        """The body's ``raise Ignore`` (``self.replace()`` raises it): done, its writes
        commit with the record, then Celery acks it without a state."""


class _CeleryRetry(RetryLater):
    """The body called ``self.retry()`` (Celery has sent the task again already, or, run
    eagerly, runs it again once this returns) or raised ``Reject(requeue=True)``: the
    pipeline rolls back and records nothing (RETRY), and Celery's own exception is raised
    on to it."""

    def __init__(self, predicate: Retry | Reject, what: str) -> None:
        super().__init__(f"the task {what}")
        self.predicate = predicate


class RefuseUnsafeSettings(bootsteps.StartStopStep):  # type: ignore[misc]
    """A worker bootstep: before the consumer takes a task (Celery starts its Consumer
    step last), refuse the settings celery_settings.py names."""

    def start(self, worker: Any) -> None:
        tasks = [t for t in worker.app.tasks.values() if isinstance(t, IdempotentTask)]
        for task in tasks:
            task.dedup_options()  # a wrong option is a ConfigurationError here too
        refuse_unsafe(worker.app, tasks)


class IdempotentTask(Task):  # type: ignore[misc]
    """A Celery Task base whose body runs once per key (see the module's docstring)."""

    engine: ClassVar[Engine | None] = None
    key: ClassVar[Callable[..., str] | None] = None
    consumer: ClassVar[str | None] = None
    tables: ClassVar[Tables] = DEFAULT
    _once: tuple[int, BlockingProcessor] | None = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Celery calls it as ``@app.task`` makes the task: its options are checked here,
        and the worker gets the bootstep that refuses unsafe settings at start."""
        cls.checked_options()
        app.steps["worker"].add(RefuseUnsafeSettings)

    @property
    def session(self) -> Session:
        """The session of the running body's transaction: its writes commit with the record."""
        try:
            return _session.get()
        except LookupError:
            raise ConfigurationError(
                f"{self.name}.session: only inside the task body as the worker runs it"
            ) from None

    def dedup_options(self) -> tuple[Engine, Callable[..., str] | None, str, Tables]:
        """The task's options, checked (ConfigurationError naming the option)."""
        return type(self).checked_options()

    @classmethod
    def checked_options(cls) -> tuple[Engine, Callable[..., str] | None, str, Tables]:
        """``dedup_options`` of the task class: checked when ``@app.task`` binds it."""
        where = f"IdempotentTask({cls.name!r})"
        engine = instance(
            cls.engine, f"{where}.engine", Engine, "a sqlalchemy Engine (create_engine)"
        )
        expected = "a function of the task's arguments returning the key"
        key = maybe(cls.key, f"{where}.key", function, expected, blocking=True)
        consumer = maybe(cls.consumer, f"{where}.consumer", text, max_length=255)
        tables = instance(cls.tables, f"{where}.tables", Tables, "a consumerdedup Tables")
        return engine, key, consumer or cls.name, tables

    def _processor(self) -> BlockingProcessor:
        """Built in the process that runs tasks (a prefork child), on first use."""
        if self._once is None or self._once[0] != os.getpid():
            engine, _, consumer, tables = self.dedup_options()
            dedup = Deduplicator(
                engine,
                consumer,
                tables=tables,
                retry=_ONE_ATTEMPT,
                dead_letter=self._dead_letter,
            )
            handler: DedupHandler = dedup.handler(self._body)
            self._once = (os.getpid(), BlockingProcessor(handler))
        return self._once[1]

    def _body(self, message: Message, session: Session) -> None:
        call = _call.get()
        token = _session.set(session)
        try:
            call.returned = self.run(*call.args, **call.kwargs)
        # Celery's own control exceptions are the body's decision, not its error
        except Retry as retry:  # RETRY, never this task's failure
            raise _CeleryRetry(retry, f"called self.retry(): {retry.humanize()}") from None
        except Reject as reject:
            if reject.requeue:  # delivered again: RETRY
                raise _CeleryRetry(reject, "raised Reject(requeue=True)") from None
            raise PermanentError("the task raised Reject(requeue=False)") from None
        except Ignore as ignore:  # acked with no state: done, so its writes commit
            call.ignored = ignore
        except MaxRetriesExceededError:
            # Its text quotes the task's arguments (which may hold a secret): never kept
            raise PermanentError(
                f"retries exhausted: {self.name} called self.retry() after its "
                f"max_retries ({self.max_retries}) retries"
            ) from None
        except Exception as exc:
            if call.last and not isinstance(exc, PermanentError):  # no retry left
                raise PermanentError(f"retries exhausted: {exc!r}") from exc
            raise
        finally:
            _session.reset(token)

    def _dead_letter(self, result: Result) -> None:
        if self.request.is_eager or self.request.called_directly:
            return  # not delivered by a broker: no queue to go back to (task.replay does)
        call = _call.get()
        _, _, consumer, _ = self.dedup_options()
        send_dead_letter(self, call.args, call.kwargs, consumer, result)

    def message_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Message:
        """The task as the pipeline sees it: keyed by ``key(*args, **kwargs)`` or the task
        id; the arguments as the body, so one key with other arguments is PayloadMismatch.
        A key function that raises or returns None: InvalidMessage."""
        message, why = self.delivered(args, kwargs)
        if why is not None:
            raise InvalidMessage(why)
        return message

    def delivered(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Delivered:
        """``message_of``'s Message, and why it has no usable key (None when it has one):
        a key function that raised or returned None refuses the task (FAILED, dead-lettered,
        as every runner refuses a delivery without an id), never keyed by something else."""
        _, key, _, _ = self.dedup_options()
        body = json.dumps([list(args), kwargs], sort_keys=True, default=repr).encode()
        info = self.request.delivery_info or {}
        source = info.get("routing_key") or self.name
        message = Message(id=None, body=body, headers={"task": self.name}, source=source)
        if key is None:
            if self.request.id is None:
                raise ConfigurationError(
                    f"{self.name} called directly has no task id to key it by: call it "
                    "through .delay()/.apply_async()/.apply(), or give the task a key="
                )
            return replace(message, id=self.request.id), None
        try:
            found = key(*args, **kwargs)
        except Exception as exc:
            # Only its type: its text may quote the task's arguments (never kept anywhere)
            return message, (
                f"no message id: {self.name}'s key function raised {type(exc).__name__} "
                "(its message is not kept: it may quote the task's arguments)"
            )
        if found is None:
            return message, f"no message id: {self.name}'s key function returned None"
        return replace(message, id=found), None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        message, why = self.delivered(args, kwargs)
        retries, most = self.request.retries or 0, self.max_retries
        call = _Call(args, kwargs, last=most is not None and retries >= most)
        token = _call.set(call)
        try:
            processor = self._processor()
            processor.check_startup()
            [result] = processor.process([(message, why)])
        finally:
            _call.reset(token)
        match result.outcome:
            case Outcome.PROCESSED if call.ignored is not None:
                raise call.ignored
            case Outcome.PROCESSED:
                return call.returned
            case Outcome.DUPLICATE:
                return self._duplicate(message)
            case Outcome.RETRY if isinstance(result.error, DeadLetterFailed):
                # recorded FAILED, its dead letter not sent: back to the broker, not acked
                raise Reject(str(result.error), requeue=True) from result.error
            case Outcome.RETRY if isinstance(result.error, _CeleryRetry):
                raise result.error.predicate  # a retry is sent again by self.retry() already
            case Outcome.RETRY:
                raise self.retry(exc=result.error)
        assert result.error is not None
        raise result.error

    def _duplicate(self, message: Message) -> Any:
        logger.info(
            "task=%s id=%s message_id=%r: DUPLICATE, processed before: the body did not run",
            self.name,
            self.request.id,
            message.id,
            extra={"consumer": self.name, "outcome": "duplicate"},
        )
        if self.request.id is None or self.ignore_result or message.id != self.request.id:
            return None  # keyed by key=: this task id is not the one whose run committed
        if self.request.is_eager and not self.app.conf.task_store_eager_result:
            return None  # an eager run stores no result to read back
        # Nothing is written before the first run's result is read: the first run stores its
        # result just after its COMMIT, which is what let this claim answer, so a twin that
        # wrote (a state, or its own None) could land after it and replace it. It is awaited,
        # for at most DUPLICATE_RESULT_WAIT (a first run killed after its COMMIT stores none).
        deadline = time.monotonic() + DUPLICATE_RESULT_WAIT
        try:
            while True:
                earlier = self.AsyncResult(self.request.id)
                if earlier.state == "SUCCESS":
                    return earlier.result
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.02)
        except NotImplementedError:  # no result backend: nothing stored to return
            return None

    def replay(
        self,
        task_id: str,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run a FAILED task again after a fix: forget its FAILED record, then send it again
        under ``task_id`` with ``args``/``kwargs`` (default: what the result backend kept,
        which needs ``result_extended=True``). The AsyncResult of the new run."""
        engine, key, consumer, tables = self.dedup_options()
        if args is None and kwargs is None:
            kept = self.AsyncResult(task_id)
            if kept.args is None:
                raise ConfigurationError(
                    f"{self.name}.replay({task_id!r}): the result backend kept no arguments "
                    "(result_extended=True keeps them): pass args= and kwargs="
                )
            args, kwargs = tuple(kept.args), dict(kept.kwargs or {})
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        message_id = key(*args, **kwargs) if key is not None else task_id
        forget(engine, consumer, [message_id], tables=tables)
        return self.apply_async(args, kwargs, task_id=task_id)
