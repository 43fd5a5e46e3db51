"""How an idle relay waits: LISTEN on PostgreSQL (woken at commit), a plain pause elsewhere."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import Engine

from ..lifecycle import StopSwitch

logger = logging.getLogger("consumerdedup.relay")

_SLICE = 0.25
"""Longest a wait goes without looking at the stop switch."""


class Listener:
    """Waits for the outbox trigger's NOTIFY, falling back to polling if it cannot listen."""

    def __init__(self, engine: Engine, channel: str) -> None:
        self.engine = engine
        self.channel = channel
        self._conn: Any = None

    def wait(self, seconds: float, switch: StopSwitch) -> None:
        """Return on a notification, after ``seconds``, or soon after ``switch.stop()``."""
        deadline = time.monotonic() + seconds
        while not switch.stopping and (left := deadline - time.monotonic()) > 0:
            conn = self._connection()
            if conn is None:
                switch.pause(min(left, _SLICE))
                continue
            try:
                for _ in conn.notifies(timeout=min(left, _SLICE), stop_after=1):
                    return
            except Exception as exc:  # the database went away: poll until it is back
                logger.debug("relay listener lost its connection: %s", exc)
                self.close()
                switch.pause(min(left, _SLICE))

    def _connection(self) -> Any:
        if self.engine.dialect.name != "postgresql":
            return None
        if self._conn is None:
            try:
                import psycopg

                url = self.engine.url.set(drivername="postgresql")
                conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
                conn.execute(f'LISTEN "{self.channel}"')
                self._conn = conn
            except Exception as exc:
                logger.debug("relay cannot LISTEN (%s); polling instead", exc)
                return None
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                logger.debug("closing the relay listener failed", exc_info=True)
            self._conn = None
