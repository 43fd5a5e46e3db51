"""``consumerdedup prune``: delete expired dedup records once, or every so often until SIGTERM.

The window comes from ``--retention``, or from the broker (``--kafka`` with
``--topics``: retention.ms; ``--rabbitmq`` with ``--queues``: the message
TTL); a broker that does not say is a usage error asking for --retention.
A broker's window applies only to the consumers named with ``--consumer``.
HTTP idempotency keys go once past the expiry stored with each (or, with
``--idempotency-keep``, once older than that); ``--idempotency-keep off``
leaves them alone.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from .. import durations
from ..errors import ConfigurationError
from ..prune.config import DEFAULT_BATCH, DEFAULT_OUTBOX_KEEP, PrunerConfig, PrunerSettings
from ..prune.idempotency import EXPIRY
from ..prune.pruner import Pruner
from ..prune.report import PruneProgress, PruneReport
from ..prune.windows import UnknownConsumer
from .common import UsageError, open_database, parse_duration, parse_windows, require_tables, say
from .redact import shown
from .retention import read_retention
from .status import add_long_running, serving

NAME = "prune"
HELP = "delete dedup records older than retention + buffer, once or --every"
PROGRESS_EVERY = "5s"
"""Default time between progress lines of a long round."""
ZERO = timedelta(0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # argparse takes "-1d" for an option and says only "expected one argument"; as a value
    # it reaches durations.parse, which says it is negative.
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = re.compile(r"^-\d[\dA-Za-z.]*$")
    source = parser.add_argument_group("retention (one of)").add_mutually_exclusive_group(
        required=True
    )
    source.add_argument("--retention", metavar="DURATION", help="e.g. 7d, 36h, 90m")
    source.add_argument(
        "--kafka", metavar="BOOTSTRAP", help="read retention.ms of --topics (for --consumer)"
    )
    source.add_argument(
        "--rabbitmq", metavar="URL", help="read the message TTL of --queues (for --consumer)"
    )
    parser.add_argument("--topics", metavar="A,B", help="with --kafka: the consumed topics")
    parser.add_argument("--queues", metavar="A,B", help="with --rabbitmq: the consumed queues")
    parser.add_argument(
        "--buffer", metavar="DURATION", help="added to the retention (default: max(1d, 10%%))"
    )
    parser.add_argument(
        "--consumer",
        metavar="NAME",
        action="append",
        help="prune only this consumer (repeatable; default: every consumer)",
    )
    parser.add_argument(
        "--window",
        metavar="NAME=DURATION",
        action="append",
        help="a consumer's own retention instead of the common one, or 'forever' (repeatable)",
    )
    keep = render(DEFAULT_OUTBOX_KEEP)
    parser.add_argument(
        "--outbox-keep",
        metavar="DURATION",
        default=keep,
        help=f"keep published outbox rows this long; 'off': leave them (default {keep})",
    )
    parser.add_argument(
        "--idempotency-keep",
        metavar="DURATION",
        default=EXPIRY,
        help=f"HTTP idempotency keys: '{EXPIRY}' (default) deletes those past the expiry "
        "stored with each; a DURATION also those created longer ago; 'off': leave them",
    )
    parser.add_argument(
        "--batch-size",
        metavar="N",
        type=int,
        default=DEFAULT_BATCH,
        help=f"rows deleted per transaction (default {DEFAULT_BATCH})",
    )
    parser.add_argument(
        "--batch-pause", metavar="DURATION", help="wait between batches, e.g. 20ms (default none)"
    )
    parser.add_argument(
        "--every", metavar="DURATION", help="run as a worker: a round every DURATION until SIGTERM"
    )
    parser.add_argument("--dry-run", action="store_true", help="count what would be deleted")
    add_long_running(parser, status_every=False)
    parser.add_argument(
        "--progress-every",
        metavar="DURATION",
        default=PROGRESS_EVERY,
        help=f"a progress line this often in a round; 0: every batch (default {PROGRESS_EVERY})",
    )


def render(value: timedelta | None) -> str:
    return "forever" if value is None else durations.render(value)


def _idempotency_keep(text: str) -> timedelta | str | None:
    chosen = text.strip().lower()
    if chosen == "off":
        return None
    if chosen == EXPIRY:
        return EXPIRY
    if chosen in durations.FOREVER:
        raise UsageError(
            f"--idempotency-keep {text!r}: keys are kept until their stored expiry by default; "
            "'off' leaves them all"
        )
    return parse_duration(text, "--idempotency-keep")


def run(args: argparse.Namespace) -> int:
    retention = parse_duration(args.retention, "--retention")
    buffer = parse_duration(args.buffer, "--buffer")
    every = parse_duration(args.every, "--every")
    settings = _settings(args)
    every_batch = args.progress_every.strip() in ("0", "0s")
    progress = (
        timedelta(0) if every_batch else parse_duration(args.progress_every, "--progress-every")
    )
    url, engine, tables = open_database(args)
    require_tables(engine, tables)
    broker = read_retention(args)
    if broker is not None:
        print(f"retention from {broker.broker}: {broker.describe()}")
        if broker.window is None:
            kept = ", ".join(s.source for s in broker.forever)
            whom = ", ".join(args.consumer)
            print(f"{kept} keep(s) records forever: the records of {whom} are never pruned")
    if args.consumer:
        settings["consumers"] = [*args.consumer, *(settings.get("windows") or {})]
    try:
        config = PrunerConfig(broker or retention, buffer, **settings)
        pruner = Pruner(
            engine,
            config=config,
            tables=tables,
            progress=_progress_printer(args, progress or ZERO),
        )
        pruner.check_consumers()
    except (UnknownConsumer, ConfigurationError) as error:
        raise UsageError(str(error)) from None
    say(args, f"{shown(url)}: {config.describe()}")
    pruner.on_signals()
    if every is None:
        _print_report(args, pruner, pruner.run_once())
        return 0
    said = Totals()

    def report(found: PruneReport) -> None:
        said.add(found)
        _print_report(args, pruner, found)

    with serving(args, engine, tables, said.counters):
        say(args, f"running every {render(every)} until SIGTERM")
        try:
            pruner.run(every, on_report=report)
        finally:
            say(args, f"pruner stopped after {said.rounds} round(s): {said.rows:,} rows deleted")
    return 0


class Totals:
    """What ``prune --every`` did since it started, for its stop line and ``/metrics``."""

    def __init__(self) -> None:
        self.rounds = self.rows = 0

    def add(self, report: PruneReport) -> None:
        self.rounds += 1
        if not report.dry_run:
            self.rows += sum(report.deleted.values()) + report.outbox + report.idempotency_keys

    def counters(self) -> dict[str, tuple[str, float]]:
        return {
            "prune_rounds": ("Pruner rounds since it started", float(self.rounds)),
            "prune_deleted_rows": ("Rows the pruner deleted since it started", float(self.rows)),
        }


def _settings(args: argparse.Namespace) -> PrunerSettings:
    """PrunerConfig's settings from the options, each option's usage error before any connection."""
    off = args.outbox_keep.strip().lower() == "off"
    settings: PrunerSettings = {
        "outbox_keep": None if off else parse_duration(args.outbox_keep, "--outbox-keep"),
        "idempotency_keep": _idempotency_keep(args.idempotency_keep),
        "windows": parse_windows(args.window),
        "batch_pause": parse_duration(args.batch_pause, "--batch-pause") or ZERO,
        "batch_size": args.batch_size,
        "dry_run": args.dry_run,
    }
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, not {args.batch_size}")
    return settings


def _print_report(args: argparse.Namespace, pruner: Pruner, report: PruneReport) -> None:
    events, outbox = pruner.tables.processed_events.fullname, pruner.tables.outbox.fullname
    if report.skipped:
        say(args, f"skipped: another pruner holds the lock on {events}")
        return
    verb = "would delete" if report.dry_run else "deleted"
    per = ", ".join(f"{c} {n:,}" for c, n in sorted(report.deleted.items()) if n)
    count = sum(report.deleted.values())
    line = f"{verb} {count:,} rows from {events}" + (f" ({per})" if per else "")
    if report.partitions:
        line += f", {len(report.partitions)} partitions whole ({', '.join(report.partitions)})"
    keys = pruner.tables.idempotency_keys.fullname
    line += f" and {report.outbox:,} published rows from {outbox}"
    line += f", {report.idempotency_keys:,} expired keys from {keys} in {report.seconds:.1f}s"
    say(args, line + (" (stopped early)" if report.stopped else ""))


def _progress_printer(args: argparse.Namespace, every: timedelta) -> Callable[[PruneProgress], Any]:
    """At most one line per ``every`` of a round (``progress.seconds`` counts from its start)."""
    shown_at = [0.0]

    def show(progress: PruneProgress) -> None:
        if progress.seconds < shown_at[0]:  # a new round
            shown_at[0] = 0.0
        if progress.seconds - shown_at[0] >= every.total_seconds():
            shown_at[0] = progress.seconds
            say(
                args,
                f"... {progress.deleted:,} rows deleted from {progress.table} so far "
                f"({progress.rate:,.0f} rows/s)",
            )

    return show
