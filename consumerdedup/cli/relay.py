"""``consumerdedup relay``: move committed outbox rows to Kafka or RabbitMQ until SIGTERM.

``--once`` publishes everything that can go now and exits (for cron or a
deploy step): 0 if all went, or some went; 1 if the broker could not be reached
or events waited and none went out; otherwise the relay runs until SIGTERM/SIGINT, finishing its
round before it exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import logging

from .. import durations
from ..errors import ConfigurationError
from ..outbox.publisher import AsyncPublisher, Publisher
from ..outbox.relay import OutboxRelay, RelayConfig
from ..reasons import describe
from .common import CommandError, Renamed, UsageError, open_database, require_tables, say
from .redact import shown
from .status import add_long_running, on_a_terminal, running

NAME = "relay"
HELP = "publish committed outbox rows to Kafka or RabbitMQ until SIGTERM (or --once)"

log = logging.getLogger(__name__)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("broker (one of)").add_mutually_exclusive_group(
        required=True
    )
    target.add_argument("--kafka", metavar="BOOTSTRAP", help="host:port[,host:port...]")
    target.add_argument(
        "--rabbitmq",
        "--amqp",
        action=Renamed,
        metavar="URL",
        help="amqp://user:password@host:5672/%%2F (--amqp: the old spelling)",
    )
    parser.add_argument(
        "--batch-size",
        "--batch",
        action=Renamed,
        type=_positive,
        default=100,
        metavar="N",
        help="rows per round (100; --batch: the old spelling)",
    )
    parser.add_argument(
        "--publish-window",
        type=_positive,
        default=500,
        metavar="N",
        help="events sent before waiting for their confirmations (500; 1: one at a time)",
    )
    parser.add_argument("--once", action="store_true", help="publish what can go now, then exit")
    parser.add_argument("--poll", metavar="DURATION", default="1s", help="idle wait (1s)")
    parser.add_argument(
        "--max-attempts", type=_positive, default=10, help="failed publishes before parking (10)"
    )
    parser.add_argument(
        "--delete-published", action="store_true", help="delete rows once published"
    )
    parser.add_argument(
        "--no-idempotence",
        action="store_true",
        help="Kafka: for brokers without idempotent producers (such as Tansu)",
    )
    add_long_running(parser, status_every=True)


def _publisher(args: argparse.Namespace) -> Publisher | AsyncPublisher:
    broker = "kafka" if args.kafka else "rabbitmq"
    try:
        adapter = importlib.import_module(f"consumerdedup.adapters.{broker}")
    except ImportError as error:
        raise UsageError(describe(error)) from None
    publisher: Publisher | AsyncPublisher
    # A bad address is the command line's fault, said now (exit 2), not charged to events.
    try:
        if args.kafka:
            publisher = adapter.KafkaPublisher(
                args.kafka, enable_idempotence=not args.no_idempotence
            )
        else:
            args.secrets.add_url(args.rabbitmq)
            publisher = adapter.RabbitPublisher(args.rabbitmq)
    except ConfigurationError as error:
        raise UsageError(f"--{broker}: {error}") from None
    return publisher


def _once_status(args: argparse.Namespace, broker_away: bool, count: int, waiting: int) -> None:
    """``--once`` fails (exit 1) when the broker could not be reached, or when events waited
    and none went out: cron and CI must be able to alert."""
    broker = f"Kafka at {args.kafka}" if args.kafka else "RabbitMQ (--rabbitmq)"
    if broker_away:
        raise CommandError(
            f"{broker} could not be reached; {waiting} event(s) waiting: check the broker's "
            "address and that it runs"
        )
    if waiting and not count:
        raise CommandError(
            f"{waiting} event(s) waiting and none published: see the warnings above, or "
            "`consumerdedup stats` for their last errors"
        )


def run(args: argparse.Namespace) -> int:
    publisher = _publisher(args)  # before the database: a bad address is said first
    url, engine, tables = open_database(args)
    try:
        config = RelayConfig(
            batch_size=args.batch_size,
            poll_interval=durations.parse(args.poll, "--poll"),
            max_attempts=args.max_attempts,
            delete_published=args.delete_published,
            publish_window=args.publish_window,
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    require_tables(engine, tables)
    with OutboxRelay(engine, publisher, tables=tables, config=config) as relay:
        if args.once:
            with on_a_terminal(args, lambda: f"... {relay.published:,} published so far"):
                count = relay.drain()
            waiting = relay.backlog()
            print(f"published {count} event(s); {waiting} waiting ({shown(url)})", flush=True)
            _once_status(args, relay.broker_away, count, waiting)
        else:
            relay.on_signals()
            say(args, f"relay running on {shown(url)}; SIGTERM or SIGINT stops it")
            with running(args, engine, tables, lambda: relay.published):
                relay.run()
        parked = relay.parked()
    if parked:
        log.error("%d event(s) parked after repeated failures: %s", len(parked), parked[:5])
    return 0
