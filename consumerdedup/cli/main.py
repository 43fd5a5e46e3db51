"""The ``consumerdedup`` command: ``init-db``, ``stats``, ``demo``, ``prune`` and ``relay``.

Each command is a module of this package with ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit code``; this module builds
the parser from them and reports their errors. Bad input is one line on
stderr and exit 2 (usage) or 1 (runtime); a traceback only with
``--verbose``. Passwords in URLs are never printed: URLs are shown masked,
and every error and log line has its passwords masked where they stand (see
redact.py); the URLs given travel as ``args.secrets``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import NoReturn, Protocol

from sqlalchemy.exc import DBAPIError

from ..errors import AuthenticationFailed
from ..reasons import authentication_refused, describe
from . import admin, demo, doctor, failed, init_db, outbox, prune, relay, run, stats
from .common import PROG, STAMP, CommandError, UsageError, add_common
from .redact import Secrets

log = logging.getLogger("consumerdedup.cli")


class Command(Protocol):
    """What a command module provides."""

    NAME: str
    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: tuple[Command, ...] = (
    init_db,
    stats,
    demo,
    prune,
    relay,
    failed,
    failed.FORGET,
    doctor,
    outbox,
    run,
    admin,
)


class ScrubbingFormatter(logging.Formatter):
    """Log lines with every password masked (the secrets the command was given, and any other),
    their times in UTC as ISO 8601 (``STAMP``, as ``common.say`` prints them)."""

    def __init__(self, fmt: str, secrets: Secrets) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        return time.strftime(STAMP, time.gmtime(record.created))

    def format(self, record: logging.LogRecord) -> str:
        return self.secrets.scrub(super().format(record))


class Parser(argparse.ArgumentParser):
    """A usage error in one line, with where to look for help."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Effectively-once message consumers: admin commands.")
    add_common(parser, nested=False)
    commands = parser.add_subparsers(metavar="COMMAND", required=True, parser_class=Parser)
    for command in COMMANDS:
        sub = commands.add_parser(command.NAME, help=command.HELP, description=command.HELP)
        add_common(sub, nested=True)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.secrets = secrets = Secrets()
    args.timestamps = long_running(args)
    setup_logging(args.verbose, secrets, echo_sql=args.echo_sql, timestamps=args.timestamps)
    try:
        refuse_undecodable(args)
        code: int = args.run(args)
        return code
    except (Exception, KeyboardInterrupt) as error:
        if args.verbose:
            sys.stderr.write(secrets.scrub(traceback.format_exc()))
        text = "interrupted" if isinstance(error, KeyboardInterrupt) else error_line(error)
        sys.stderr.write(f"{PROG}: error: {' '.join(secrets.scrub(text).split())}\n")
        if isinstance(error, KeyboardInterrupt):
            return 130
        return error.code if isinstance(error, CommandError) else 1


def refuse_undecodable(args: argparse.Namespace) -> None:
    """Every argument in valid Unicode, checked once for every command: bytes the locale
    cannot decode reach Python as lone surrogates, which no database, broker or terminal
    takes (``failed list --consumer $'\\xff'`` ended with exit 1 and UnicodeEncodeError).
    The value is not quoted: it may be a URL with its password."""
    for name, value in vars(args).items():
        for item in value if isinstance(value, list | tuple) else (value,):
            if not isinstance(item, str):
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise UsageError(
                    f"the {name.replace('_', ' ')} given is not valid text in this locale's "
                    "encoding (a byte that does not decode); give it in UTF-8"
                ) from None


def error_line(error: Exception) -> str:
    if isinstance(error, CommandError):
        return str(error)
    if isinstance(error, DBAPIError) and authentication_refused(error):
        return f"{AuthenticationFailed.__name__}: {describe(error.orig or error)}"
    if isinstance(error, DBAPIError) and error.orig is not None:
        return f"database error: {describe(error.orig)}"
    return describe(error)


BROKER_CLIENTS = ("pika", "aiokafka")
"""Loggers of the broker clients: each failed connection attempt is a line and a traceback
there, and the command's own line says what it came to."""
REPEAT_QUIET = 30.0
"""Seconds a broker client's same line is not shown again (a reconnect loop says it often)."""


class BrokerClientLines(logging.Filter):
    """A broker client's record without its traceback, once per REPEAT_QUIET per line."""

    def __init__(self) -> None:
        super().__init__()
        self._shown: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(BROKER_CLIENTS):
            return True
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        key, now = (record.name, record.msg), time.monotonic()
        if now - self._shown.get(key, -REPEAT_QUIET) < REPEAT_QUIET:
            return False
        self._shown[key] = now
        return True


def setup_logging(
    verbose: bool, secrets: Secrets, *, echo_sql: bool = False, timestamps: bool = False
) -> None:
    """Lines on stderr with their passwords masked; ``timestamps`` for a long-running
    command (every line says when, the broker clients' warnings shown without their
    tracebacks), ``verbose`` for DEBUG and the broker clients' own tracebacks,
    ``echo_sql`` for the SQL that runs."""
    handler = logging.StreamHandler(sys.stderr)
    detail = "%(levelname)s %(name)s" if verbose else PROG + ": %(levelname)s"
    if verbose or timestamps:
        detail = "%(asctime)s " + detail
    handler.setFormatter(ScrubbingFormatter(detail + ": %(message)s", secrets))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    warnings.showwarning = _show_warning
    if not verbose:
        # A long run's log shows the client's reconnects (one line each, repeats collapsed);
        # a one-shot command's own error line says what they came to: one line, exit 1.
        handler.addFilter(BrokerClientLines())
        for name in BROKER_CLIENTS:
            logging.getLogger(name).setLevel(logging.WARNING if timestamps else logging.CRITICAL)
    if echo_sql:  # SQLAlchemy quiets itself to WARNING; INFO shows the SQL it runs
        logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO)


def long_running(args: argparse.Namespace) -> bool:
    """``relay`` without ``--once`` and ``prune --every``: they run for days, their lines
    go to a log collector that needs to know when each was said."""
    if args.run is relay.run:
        return not args.once
    return args.run is prune.run and args.every is not None


def _show_warning(
    message: Warning | str, category: type[Warning], *_: object, **__: object
) -> None:
    log.warning("%s: %s", category.__name__, message)  # one line, scrubbed by the formatter
