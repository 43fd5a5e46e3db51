"""The Celery settings an IdempotentTask refuses, checked when a worker starts.

The dedup record makes a redelivered task answer DUPLICATE; it cannot bring back a
task the broker dropped, nor stop a broker from handing a running task to another
worker. So a worker whose settings allow either refuses to start (a ConfigurationError
as Celery's "Unrecoverable error", exit code 1), before its consumer takes a task:

* ``acks_late`` off: the message is acked before the body runs; a worker that dies in
  the body loses the task (it is not doubled: it is gone, and no record says so).
* ``reject_on_worker_lost`` off: a pool child killed mid-task (OOM, SIGKILL) has its
  task acked, so the same loss.
* On Redis and SQS, a ``visibility_timeout`` not longer than the task's hard time limit,
  or no time limit at all: the broker redelivers a task still running. The twin's claim
  then waits on the first one's uncommitted record (PostgreSQL, MySQL: a row lock;
  SQLite: the database lock) and answers DUPLICATE once it commits, so nothing applies
  twice, but a worker slot is held for as long as the first run takes, and on SQLite
  the wait can outlast its busy timeout. A time limit below the timeout makes the
  first run end before the broker gives up on it.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigurationError

VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}
"""kombu's visibility_timeout (seconds) by broker URL scheme when none is set."""


def unsafe_settings(app: Any, task: Any) -> list[str]:
    """Why ``task`` must not run on ``app``'s workers, one line per reason (empty: safe)."""
    found = []
    if not task.acks_late:
        found.append(
            "acks_late is off (task_acks_late=False): a task is acked before it runs, so a "
            "worker that dies in it loses it; set task_acks_late=True"
        )
    if not task.reject_on_worker_lost:
        found.append(
            "reject_on_worker_lost is off (task_reject_on_worker_lost=False): a killed pool "
            "child acks its task, so it is lost; set task_reject_on_worker_lost=True"
        )
    scheme = str(app.conf.broker_url or "").split("://", 1)[0].split("+")[0].lower()
    if scheme in VISIBILITY_DEFAULTS:
        options = app.conf.broker_transport_options or {}
        visibility = float(options.get("visibility_timeout", VISIBILITY_DEFAULTS[scheme]))
        limit = task.time_limit if task.time_limit is not None else app.conf.task_time_limit
        if limit is None or float(limit) >= visibility:
            given = "no time limit" if limit is None else f"a time limit of {limit:g} s"
            found.append(
                f"{given} on a {scheme} broker whose visibility_timeout is {visibility:g} s: "
                "the broker hands a task still running to another worker (its claim then "
                "waits for the first run and answers DUPLICATE, holding a worker meanwhile); "
                "set task_time_limit below broker_transport_options['visibility_timeout']"
            )
    return found


def refuse_unsafe(app: Any, tasks: list[Any]) -> None:
    """ConfigurationError naming every unsafe setting and its tasks (see the module)."""
    names: dict[str, list[str]] = {}
    for task in tasks:
        for reason in unsafe_settings(app, task):
            names.setdefault(reason, []).append(task.name)
    if names:
        said = "; ".join(
            f"{', '.join(repr(n) for n in sorted(tasks))}: {reason}"
            for reason, tasks in names.items()
        )
        raise ConfigurationError(f"consumerdedup.celery.IdempotentTask refuses to run: {said}")
