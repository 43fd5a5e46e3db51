"""``--reload`` for development: watch the service's source and restart its worker on a
change, through watchfiles (the extra ``consumerdedup[reload]``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import ConfigurationError

log = logging.getLogger("consumerdedup.reload")
INSTALL = "pip install 'consumerdedup[reload]'"


class Reloader:
    """A daemon thread calling ``changed()`` after each change of a .py file under
    ``root``; ``stop()`` ends it."""

    def __init__(self, root: Path, changed: Callable[[], None]) -> None:
        try:
            import watchfiles
        except ImportError:
            raise ConfigurationError(f"--reload needs watchfiles: {INSTALL}") from None
        self._watchfiles = watchfiles
        self.root, self.changed = root, changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reload", daemon=True)

    def start(self) -> Reloader:
        self._thread.start()
        log.warning("--reload: watching %s for changes (development only)", self.root)
        return self

    def _run(self) -> None:
        watch = self._watchfiles.watch(
            self.root,
            watch_filter=self._watchfiles.PythonFilter(),
            stop_event=self._stop,
            raise_interrupt=False,
        )
        for changes in watch:
            log.warning("changed: %s", ", ".join(sorted({Path(p).name for _, p in changes})))
            self.changed()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
