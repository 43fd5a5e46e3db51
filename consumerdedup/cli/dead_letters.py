"""``doctor --rabbitmq/--kafka``: how many dead letters wait in the DLQ of each ``--queues``
queue or ``--topics`` topic (its name plus ``.dlq``, the runners' default); on Kafka, those
the replay group (``failed replay``) has not passed yet."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from ..doctor import FAIL, Check
from ..headers import DEAD_LETTER_SUFFIX
from ..reasons import describe
from .common import UsageError


def depths(args: argparse.Namespace) -> tuple[dict[str, int | None] | None, Check | None]:
    """The depth of each DLQ (None: not there); a broker that cannot be asked is a FAIL
    line instead."""
    if (args.topics and not args.kafka) or (args.queues and not args.rabbitmq):
        raise UsageError("--topics goes with --kafka, --queues with --rabbitmq")
    names = [n.strip() for n in (args.topics or args.queues or "").split(",") if n.strip()]
    if not names:
        raise UsageError("--kafka needs --topics A,B and --rabbitmq needs --queues A,B")
    dlqs = [name + DEAD_LETTER_SUFFIX for name in names]
    try:
        # Each broker's client is an optional extra, imported only when asked for.
        depths_of: Any = importlib.import_module("consumerdedup.failed.depths")
        if args.rabbitmq:
            args.secrets.add_url(args.rabbitmq)
            found: dict[str, int | None] = depths_of.rabbitmq_depths(args.rabbitmq, dlqs)
        else:
            found = depths_of.kafka_depths(args.kafka, dlqs)
        return found, None
    except ImportError as error:
        raise UsageError(describe(error)) from None
    except Exception as error:
        fix = "check the broker's address and credentials, and that it runs"
        return None, Check("dead letters", FAIL, f"cannot count them: {describe(error)}", fix)
