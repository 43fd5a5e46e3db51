"""Round 10, fresh eyes on issue 32 item 4: the App in-process, ``await app.run_async()``,
whose docstring promises that cancelling it stops the parts.

Seen failing before the fix (18 cancels out of 20 right after the start hung): run() reset
its stop flag after building the parts, so a stop() that came while they were being built
(a cancel of run_async() at its start: a test's teardown, a lifespan shut down early) found
no parts to stop and was then forgotten; the parts ran, and the cancelled run_async()
waited for them for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from consumerdedup import App, Message
from consumerdedup.app import Settings
from consumerdedup.testing import MemoryBroker
from tests.conftest import Database

TRIES = 5


def _app(db: Database) -> App:
    app = App("shop", engine=db.engine, tables=db.tables)

    @app.rabbitmq(queue="payments", consumer="payments")
    def apply(message: Message, session: Any) -> None:
        pass

    return app


async def test_run_async_cancelled_at_its_start_stops(sqlite_db: Database) -> None:
    app = _app(sqlite_db)
    for _ in range(TRIES):
        task = asyncio.create_task(
            app.run_async(settings=Settings.load(), memory_broker=MemoryBroker())
        )
        await asyncio.sleep(0)  # started: its thread is on its way, the parts not built yet
        task.cancel()
        try:
            await asyncio.wait_for(asyncio.shield(task), 30)
        except asyncio.CancelledError:
            pass
        except TimeoutError:
            app.stop()  # let the test end; the cancel alone did not stop it
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 30)
            raise AssertionError("a run_async() cancelled at its start never returned") from None
        assert task.cancelled()


async def test_a_stop_before_run_is_not_the_next_runs(sqlite_db: Database) -> None:
    app = _app(sqlite_db)
    app.stop()  # nothing runs: a no-op, not a stop of the run to come
    broker = MemoryBroker()
    broker.publish("payments", b"{}", message_id="p-1")
    await app.run_async(settings=Settings.load(), memory_broker=broker, until_idle=True)
    assert broker.held("payments") == 0  # the run took its message
