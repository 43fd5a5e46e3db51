"""``prune --kafka`` / ``--rabbitmq``: the window read from the broker, or one line saying why not.

Kafka: retention.ms (+ segment.ms) of ``--topics``; RabbitMQ: the message TTL
of ``--queues``. The window read applies only to the consumers named with
``--consumer``, so without them the broker is not even asked. The adapters are
optional extras, imported only when asked for.
"""

from __future__ import annotations

import argparse
import importlib
import logging
from urllib.parse import urlsplit

from ..errors import ConfigurationError
from ..prune.windows import BrokerRetention, RetentionUnknown
from ..reasons import describe
from .common import CommandError, UsageError


def read_retention(args: argparse.Namespace) -> BrokerRetention | None:
    """None without --kafka or --rabbitmq; UsageError for options that do not go together."""
    if (args.topics and not args.kafka) or (args.queues and not args.rabbitmq):
        raise UsageError("--topics goes with --kafka, --queues with --rabbitmq")
    if (args.kafka and not args.topics) or (args.rabbitmq and not args.queues):
        raise UsageError("--kafka needs --topics A,B and --rabbitmq needs --queues A,B")
    if not (args.kafka or args.rabbitmq):
        return None
    option = "--kafka" if args.kafka else "--rabbitmq"
    if not args.consumer:  # asked before the broker: the answer could not be used anyway
        names = ", ".join(n.strip() for n in (args.topics or args.queues).split(","))
        raise UsageError(
            f"{option}: the window read applies only to the consumers of {names}; "
            "name them with --consumer NAME (repeatable)"
        )
    if args.rabbitmq:
        args.secrets.add_url(args.rabbitmq)
    if not args.verbose:  # the drivers log each failed connection attempt: one line is enough
        logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
        logging.getLogger("pika").setLevel(logging.CRITICAL)
    # The adapters are optional extras; imported by name (as cmd_demo does) only when asked for.
    try:
        if args.kafka:
            kafka = importlib.import_module("consumerdedup.adapters.kafka.retention")
            found: BrokerRetention = kafka.kafka_retention(args.kafka, args.topics.split(","))
        else:
            rabbit = importlib.import_module("consumerdedup.adapters.rabbitmq.retention")
            found = rabbit.rabbitmq_retention(args.rabbitmq, args.queues.split(","))
        return found
    except RetentionUnknown as error:
        raise UsageError(f"{error}: pass --retention DURATION instead of {option}") from None
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    except ImportError as error:
        raise UsageError(describe(error)) from None
    except Exception as error:
        where = args.kafka or _address(args.rabbitmq)
        raise CommandError(
            f"cannot read the retention from {where} ({option}): {_text(error)}"
        ) from error


def _address(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 5672}"


def _text(error: BaseException) -> str:
    """``describe``, without the class name twice (aiokafka puts it in its messages)."""
    text = " ".join(str(error).split())
    return text if text.startswith(type(error).__name__) else describe(error)
