"""``consumerdedup admin --db URL [--port 8090]``: the admin web pages (consumerdedup.admin)
served by uvicorn.

It binds 127.0.0.1 unless ``--host`` says otherwise; any other address needs a token
(read from ``$CONSUMERDEDUP_ADMIN_TOKEN`` or ``--token-file``, never from the command
line, where ``ps`` shows it). Without a token, any client of this host may look (the
loopback bind is the explicit choice ``admin_app(allow_loopback=True)`` asks for).
Read-only unless ``--actions``; every action goes to the audit log (stderr, and
``--audit-log FILE`` as JSON lines).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from ..loopback import is_loopback
from .common import UsageError, open_reading

NAME = "admin"
HELP = "serve the admin web pages (failures, outbox, overview) on 127.0.0.1"
TOKEN_ENV = "CONSUMERDEDUP_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=8090, help="(default %(default)s)")
    parser.add_argument(
        "--actions",
        action="store_true",
        help="enable forget, replay and abandon (default: read-only)",
    )
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"a file holding the access token (or ${TOKEN_ENV}); required off loopback",
    )
    broker = parser.add_mutually_exclusive_group()
    broker.add_argument("--rabbitmq", metavar="URL", help="replay dead letters through RabbitMQ")
    broker.add_argument("--kafka", metavar="BOOTSTRAP", help="replay dead letters through Kafka")
    parser.add_argument(
        "--dead-letter-queue",
        "--dead-letter-topic",
        dest="dead_letters",
        metavar="CONSUMER=NAME",
        action="append",
        help="a consumer's dead-letter queue (RabbitMQ) or topic (Kafka), for replay; "
        "repeat per consumer",
    )
    parser.add_argument("--audit-log", metavar="FILE", help="append every action as a JSON line")
    parser.add_argument(
        "--audit-table",
        action="store_true",
        help="write every action to the admin_audit table (init-db --admin-audit) and show "
        "the Audit page",
    )
    parser.add_argument(
        "--show-bodies", action="store_true", help="show outbox event bodies (default: hidden)"
    )


def read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as error:
            raise UsageError(f"--token-file: cannot read it ({error.strerror})") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if token and len(token) < 16:
        raise UsageError("the admin token must be at least 16 characters")
    return token or None


def run(args: argparse.Namespace) -> int:
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be 1 to 65535, got {args.port}")
    token = read_token(args)
    if token is None and not is_loopback(args.host):
        raise UsageError(
            f"--host {args.host} is not loopback: give a token ($ {TOKEN_ENV} or --token-file)"
        )
    queues: dict[str, str] = {}
    for entry in args.dead_letters or []:
        consumer, _, queue = entry.partition("=")
        if not consumer.strip() or not queue.strip():
            raise UsageError(f"--dead-letter-queue {entry!r}: expected CONSUMER=NAME")
        queues[consumer.strip()] = queue.strip()
    if bool(queues) != bool(args.rabbitmq or args.kafka):
        raise UsageError(
            "--rabbitmq (or --kafka) and --dead-letter-queue (or --dead-letter-topic) go "
            "together (replay needs both)"
        )
    try:
        import uvicorn

        from ..admin import KafkaReplay, RabbitMQReplay, admin_app
    except ImportError as error:
        raise UsageError(f"{error}; install consumerdedup[admin]") from None
    _, engine, tables = open_reading(args, lambda t: t.processed_events)
    replay: RabbitMQReplay | KafkaReplay | None = None
    if args.rabbitmq:
        args.secrets.add_url(args.rabbitmq)
        replay = RabbitMQReplay(args.rabbitmq, queues)
    elif args.kafka:
        replay = KafkaReplay(args.kafka, queues)
    audit_log = logging.getLogger("consumerdedup.admin.audit")
    audit_log.setLevel(logging.INFO)
    if args.audit_log:
        handler = logging.FileHandler(args.audit_log)
        handler.setFormatter(logging.Formatter("%(message)s"))
        audit_log.addHandler(handler)
    app = admin_app(
        engine,
        tables=tables,
        allow_loopback=token is None,
        token=token,
        actions=args.actions,
        replay=replay,
        show_bodies=args.show_bodies,
        audit="table" if args.audit_table else None,
    )
    mode = "actions enabled" if args.actions else "read-only"
    guard = "token required" if token else "loopback clients only"
    print(f"admin pages on http://{args.host}:{args.port}/ ({mode}, {guard})", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    uvicorn.Server(config).run()
    print("admin pages stopped", flush=True)
    return 0
