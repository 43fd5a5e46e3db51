"""With neither extra installed, everything works and nothing of them is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys

    BLOCKED = ("opentelemetry", "prometheus_client")

    class Uninstalled:  # as if the extras were not installed: importing them fails
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}")
            return None

    sys.meta_path.insert(0, Uninstalled())

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    import consumerdedup.cli.main  # every command's module, stats and the relay's too
    from consumerdedup import Deduplicator, Outbox, OutboxRelay, install, telemetry
    from consumerdedup.testing import MemoryBroker, MemoryConsumerRunner
    from consumerdedup.errors import ConfigurationError

    engine = create_engine("sqlite://")
    install(engine)
    broker = MemoryBroker()
    with Session(engine) as session, session.begin():
        Outbox().add(session, "orders", b"{}")
    with OutboxRelay(engine, broker) as relay:
        assert relay.drain() == 1
    dedup = Deduplicator(engine, consumer="c")
    handler = dedup.handler(lambda message, session: None)
    runner = MemoryConsumerRunner(handler, "orders", broker=broker)
    runner.run(until_idle=True)
    assert [r.value for r in runner.outcomes] == ["processed"], runner.outcomes
    try:
        telemetry.instrument()
    except ConfigurationError as error:
        assert "consumerdedup[otel]" in str(error)
    else:
        raise AssertionError("instrument() without the API must say what to install")
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("ok")
    """
)


def test_nothing_of_the_extras_is_imported_and_everything_works() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
