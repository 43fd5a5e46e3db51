"""How an idle relay waits: LISTEN on PostgreSQL (woken at commit); on MySQL and MariaDB
woken by commits in this process (wakeup.py), else polling with jitter; a plain pause on
SQLite."""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from sqlalchemy import Engine, Table

from ..db.names import table_sql
from ..lifecycle import StopSwitch
from ..reasons import describe
from ..schema import notify_channel_of
from . import wakeup
from .mysql import is_mysql

logger = logging.getLogger("consumerdedup.relay")

_SLICE = 0.25
"""Longest a wait goes without looking at the stop switch."""
JITTER = 0.2
"""MySQL: an idle relay's poll interval varies by this fraction either way, so relays
started together do not scan the outbox in step."""
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
        self.mysql = is_mysql(engine.dialect.name)
        self._seen = 0  # MySQL: the outbox's wake-up counter when this relay last looked

    def listen(self) -> None:
        """LISTEN now (PostgreSQL), before the first look at the table; on MySQL, note the
        wake-up counter (a commit during the first round then ends the first wait)."""
        if self.mysql:
            self._seen = wakeup.current(self.table.fullname)
            return
        self._connection()

    def wait(self, seconds: float, switch: StopSwitch) -> None:
        """Return on a notification, after ``seconds``, or soon after ``switch.stop()``."""
        if self.mysql:
            self._wait_woken(seconds * random.uniform(1 - JITTER, 1 + JITTER), switch)
            return
        deadline = time.monotonic() + seconds
        while not switch.stopping and (left := deadline - time.monotonic()) > 0:
            switch.tick()  # waiting for news is the relay's loop turning, for liveness
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

    def _wait_woken(self, seconds: float, switch: StopSwitch) -> None:
        """MySQL: until a commit of this process bumps the outbox's counter (or one did since
        the last look), ``seconds`` pass, or ``switch.stop()``."""
        name = self.table.fullname
        deadline = time.monotonic() + seconds
        while not switch.stopping and (left := deadline - time.monotonic()) > 0:
            switch.tick()
            if wakeup.wait(name, self._seen, min(left, _SLICE)):
                break
        self._seen = wakeup.current(name)

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
