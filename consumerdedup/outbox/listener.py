"""How an idle relay waits: LISTEN on PostgreSQL (woken at commit), a plain pause elsewhere."""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import Engine, Table

from ..db.names import table_sql
from ..lifecycle import StopSwitch
from ..reasons import describe
from ..schema import notify_channel_of

logger = logging.getLogger("consumerdedup.relay")

_SLICE = 0.25
"""Longest a wait goes without looking at the stop switch."""
_RESOLVE = "SELECT CAST(CAST(%s AS regclass) AS oid)"
"""The outbox's OID, however its name is spelled: what the trigger's channel is named by."""


class Listener:
    """Waits for the outbox trigger's NOTIFY, falling back to polling if it cannot listen.

    The channel is the table's OID, resolved by PostgreSQL (as the relay's locks are), so
    a relay given ``outbox`` hears the trigger of ``public.outbox``. It also listens on
    ``legacy_channel``, where triggers installed by earlier releases still notify.
    """

    def __init__(self, engine: Engine, table: Table, legacy_channel: str | None = None) -> None:
        self.engine = engine
        self.table = table
        self.legacy_channel = legacy_channel
        self.channels: list[str] = []
        self._conn: Any = None
        self._warned = False

    def listen(self) -> None:
        """LISTEN now (PostgreSQL), before the first look at the table; no-op elsewhere."""
        self._connection()

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
                self._conn = self._listening()
            except Exception as exc:
                self._cannot_listen(exc)
                return None
            self._warned = False  # listening again: a later failure is news again
        return self._conn

    def _listening(self) -> Any:
        import psycopg

        url = self.engine.url.set(drivername="postgresql")
        conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
        try:
            [oid] = conn.execute(_RESOLVE, (table_sql(self.table),)).fetchone() or (None,)
            channels = [notify_channel_of(oid)]
            if self.legacy_channel and self.legacy_channel not in channels:
                channels.append(self.legacy_channel)
            for channel in channels:
                conn.execute(f'LISTEN "{channel}"')
        except BaseException:
            conn.close()
            raise
        self.channels = channels
        return conn

    def _cannot_listen(self, exc: Exception) -> None:
        """Once at WARNING (the relay then waits a whole poll interval for news), then DEBUG
        at each retry, until listening works again."""
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        logger.log(
            level,
            "relay cannot LISTEN for new outbox rows (%s); polling every poll_interval instead",
            describe(exc),
        )

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:
                logger.debug("closing the relay listener failed", exc_info=True)
            self._conn = None
