"""``consumerdedup doctor``: check a deployment; a checklist with the fix for each line.

Exit 0 when no line is FAIL (warn lines are worth a look), 1 otherwise. The
windows are given as to ``prune`` (``--retention``, ``--window NAME=DURATION``,
``--buffer``); with ``--kafka``/``--rabbitmq`` each ``--consumer``'s window is
compared with the retention its broker reports (retention.py, as prune reads it), and
the dead letters waiting in each queue's or topic's DLQ are counted. FAILED records and
dead letters are a warn; past ``--max-failed N`` a FAIL.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import timedelta
from typing import Any

from ..doctor import FAIL, Check, Settings, diagnose
from ..errors import ConfigurationError
from ..prune.windows import BrokerRetention
from . import dead_letters
from .common import CommandError, UsageError, open_database, parse_duration, parse_windows
from .redact import shown
from .retention import read_retention

NAME = "doctor"
HELP = "check a deployment: database, tables, trigger, partitions, outbox, locks, windows"
_WIDTH = 18


def add_arguments(parser: argparse.ArgumentParser) -> None:
    windows = parser.add_argument_group("windows (as given to prune)")
    windows.add_argument("--retention", metavar="DURATION", help="every consumer's window")
    windows.add_argument(
        "--window", metavar="NAME=DURATION", action="append", help="a consumer's own (repeatable)"
    )
    windows.add_argument("--buffer", metavar="DURATION", help="default: max(1d, 10%%)")
    broker = parser.add_argument_group("the broker's retention (for --consumer)")
    broker.add_argument("--kafka", metavar="BOOTSTRAP", help="read retention.ms of --topics")
    broker.add_argument("--rabbitmq", metavar="URL", help="read the message TTL of --queues")
    broker.add_argument("--topics", "--topic", metavar="A,B", help="with --kafka")
    broker.add_argument("--queues", "--queue", metavar="A,B", help="with --rabbitmq")
    broker.add_argument(
        "--consumer", metavar="NAME", action="append", help="a consumer of them (repeatable)"
    )
    parser.add_argument(
        "--max-attempts",
        metavar="N",
        type=int,
        default=10,
        help="parked = attempts >= N where the outbox has no parked_at (default 10)",
    )
    parser.add_argument(
        "--outbox-max-age",
        metavar="DURATION",
        default="5m",
        help="FAIL when an unpublished event is older (default 5m)",
    )
    relays = parser.add_argument_group("the relays (PostgreSQL's shared lock table)")
    relays.add_argument(
        "--relays", metavar="N", type=int, default=1, help="relays running at once (default 1)"
    )
    relays.add_argument(
        "--relay-batch-size", metavar="N", type=int, help="their --batch-size (default 100)"
    )
    parser.add_argument(
        "--max-failed",
        metavar="N",
        type=int,
        help="FAIL (exit 1) when more than N FAILED records, or dead letters in a broker's "
        "DLQs, wait (default: any number is a warn)",
    )
    parser.add_argument("--json", action="store_true", help="the checks as JSON")


def _settings(**given: Any) -> Settings:
    """The checks' Settings from the command line: a value they refuse is a usage error
    (``--max-failed 10**23`` ended with exit 1, as a failing check does)."""
    try:
        return Settings(**given)
    except ConfigurationError as error:  # named as the command line names it
        said = re.sub(r"Settings\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(error))
        raise UsageError(said.replace("--windows", "--window")) from None


def run(args: argparse.Namespace) -> int:
    if args.kafka and args.rabbitmq:
        raise UsageError("--kafka and --rabbitmq: give one broker")
    if args.relays < 1 or (args.relay_batch_size is not None and args.relay_batch_size < 1):
        raise UsageError("--relays and --relay-batch-size must be >= 1")
    if args.max_failed is not None and args.max_failed < 0:
        raise UsageError(f"--max-failed must be >= 0, got {args.max_failed}")
    windows = parse_windows(args.window)
    max_age = parse_duration(args.outbox_max_age, "--outbox-max-age") or timedelta(minutes=5)
    settings = _settings(
        retention=parse_duration(args.retention, "--retention"),
        windows=windows,
        buffer=parse_duration(args.buffer, "--buffer"),
        consumers=tuple(args.consumer or windows),
        max_attempts=args.max_attempts,
        outbox_max_age=max_age,
        relays=args.relays,
        relay_batch_size=args.relay_batch_size,
        max_failed=args.max_failed,
    )
    url, engine, tables = open_database(args)
    found: list[Check] = []
    if args.kafka or args.rabbitmq or args.topics or args.queues:
        args.consumer = list(settings.consumers)
        broker, check = _broker(args) if args.consumer else (None, None)
        depths, unread = (None, None) if check else dead_letters.depths(args)
        settings = Settings(**{**settings.__dict__, "broker": broker, "dead_letters": depths})
        found += [c for c in (check, unread) if c]
    try:
        found = [*diagnose(engine, tables, settings), *found]
    finally:
        engine.dispose()
    scrub = args.secrets.scrub
    if args.json:
        failing = any(c.status == FAIL for c in found)
        report = {"database": shown(url), "ok": not failing, "checks": [c.as_dict() for c in found]}
        print(scrub(json.dumps(report, indent=2)))
    else:
        print(f"{shown(url)}:")
        for check in found:
            print(scrub(f"  {check.status:<5} {check.name:<{_WIDTH}} {check.detail}"))
            if check.fix and check.status != "ok":
                print(scrub(f"  {'':<5} {'':<{_WIDTH}} fix: {check.fix}"))
        counts = {s: sum(c.status == s for c in found) for s in (FAIL, "warn", "ok")}
        print(", ".join(f"{n} {s}" for s, n in counts.items() if n))
    return 1 if any(c.status == FAIL for c in found) else 0


def _broker(args: argparse.Namespace) -> tuple[BrokerRetention | None, Check | None]:
    """The broker's retention; a broker that cannot be asked is a FAIL line, not an exit."""
    try:
        return read_retention(args), None
    except UsageError:
        raise
    except CommandError as error:
        fix = "check the broker's address and credentials, and that it runs"
        return None, Check("broker", FAIL, str(error), fix)
