"""IdempotentTask's options are checked as ``@app.task`` makes the task (Invariant 10): no
worker, no broker connection needed."""

from __future__ import annotations

import re
from typing import Any

import pytest
from sqlalchemy import create_engine

from consumerdedup import ConfigurationError

celery = pytest.importorskip("celery")
from consumerdedup.celery import IdempotentTask  # noqa: E402


def make(**options: Any) -> Any:
    app = celery.Celery("options", broker="memory://", set_as_current=False)

    @app.task(name="cdd.options", base=IdempotentTask, bind=True, **options)
    def body(self: Any, order_id: str) -> None:
        pass

    return body.name  # evaluating the proxy makes the task


def test_a_right_task_is_made() -> None:
    assert make(engine=create_engine("sqlite://"), key=lambda order_id: order_id) == "cdd.options"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({}, "IdempotentTask('cdd.options').engine"),
        ({"engine": "sqlite://"}, "IdempotentTask('cdd.options').engine"),
        ({"key": "order_id"}, "IdempotentTask('cdd.options').key"),
        ({"consumer": 7}, "IdempotentTask('cdd.options').consumer"),
        ({"tables": "processed_events"}, "IdempotentTask('cdd.options').tables"),
    ],
)
def test_a_wrong_option_is_refused_where_given(options: dict[str, Any], named: str) -> None:
    if not named.endswith(".engine"):
        options.setdefault("engine", create_engine("sqlite://"))
    with pytest.raises(ConfigurationError, match="^" + re.escape(named)):
        make(**options)


def test_an_async_key_is_refused() -> None:
    async def key(order_id: str) -> str:
        return order_id

    with pytest.raises(ConfigurationError, match="plain def"):
        make(engine=create_engine("sqlite://"), key=key)


def test_an_eager_failure_is_recorded_not_dead_lettered(tmp_path: Any) -> None:
    """``apply()`` (or task_always_eager) runs the body without a broker delivery: FAILED
    is recorded, and no dead letter is sent (nothing came from a queue to go back to)."""
    from sqlalchemy import text

    from consumerdedup import PermanentError, install
    from consumerdedup.failed.celery import waiting

    engine = create_engine(f"sqlite:///{tmp_path / 'eager.db'}")
    install(engine)
    app = celery.Celery("eager", broker="memory://", set_as_current=False)

    @app.task(name="cdd.eager", base=IdempotentTask, bind=True, engine=engine)
    def declined(self: Any, order_id: str) -> None:
        raise PermanentError("card declined")

    ran = declined.apply(("o-1",), task_id="t-1")
    assert ran.failed()
    with engine.connect() as conn:
        found = conn.execute(text("SELECT message_id, outcome FROM processed_events")).all()
    assert [tuple(r) for r in found] == [("t-1", "failed")]
    assert waiting(app, "celery.dlq") == 0
