"""What every command shares: its errors, the common options, the database URL, the engine
and the tables, and the duration options (``--retention``, ``--window NAME=DURATION``) that
``prune`` and ``doctor`` both read.

The URLs a command is given travel as ``args.secrets`` (a redact.Secrets), so
that whatever prints them shows them masked.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, Table, create_engine, inspect
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from .. import durations
from ..db.dialects import SUPPORTED, supported_drivers
from ..errors import ConfigurationError
from ..reasons import describe
from ..schema import Tables
from .redact import Secrets, shown

PROG = "consumerdedup"
ENV_URL = "CONSUMERDEDUP_DB_URL"

STAMP = "%Y-%m-%dT%H:%M:%SZ"
"""When a line of a long-running command was said: UTC, ISO 8601."""

log = logging.getLogger("consumerdedup.cli")


def say(args: argparse.Namespace, line: str) -> None:
    """``line`` on stdout, now; stamped with the time (UTC) in a long-running command."""
    if getattr(args, "timestamps", False):
        line = f"{time.strftime(STAMP, time.gmtime())} {line}"
    print(line, flush=True)


def printable(text: str) -> str:
    """``text`` for the operator's terminal: every control, format or separator character
    (a newline, ESC, a bidi override) escaped as Python writes it. Ids and reasons are the
    producers' text: raw, a newline forges a table row and ESC rewrites the screen."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class CommandError(Exception):
    """A failure reported as one line: exit 1 (runtime)."""

    code = 1


class UsageError(CommandError):
    """Bad input on the command line: exit 2."""

    code = 2


class Renamed(argparse.Action):
    """An option whose last name is its old spelling: still accepted, with a warning."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        new, old = self.option_strings[0], self.option_strings[-1]
        if option_string == old != new:
            sys.stderr.write(f"{PROG}: warning: {old} is deprecated, use {new}\n")
        setattr(namespace, self.dest, values)


def add_common(parser: argparse.ArgumentParser, *, nested: bool) -> None:
    """The shared options; a subcommand's defaults must not mask values given before it."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if nested else value

    group = parser.add_argument_group("common options")
    env_url = os.environ.get(ENV_URL)
    group.add_argument("--db", metavar="URL", default=default(env_url), help=f"or ${ENV_URL}")
    pe_default = default("processed_events")
    group.add_argument("--processed-events-table", metavar="NAME", default=pe_default)
    group.add_argument("--outbox-table", metavar="NAME", default=default("outbox"))
    verbose = "log at DEBUG; show tracebacks on errors (the broker clients' too)"
    group.add_argument("--verbose", action="store_true", default=default(False), help=verbose)
    echo = "log every SQL statement that runs (SQLAlchemy's echo)"
    group.add_argument("--echo-sql", action="store_true", default=default(False), help=echo)


Action = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]
"""A command's action (``failed list``): name, help, its options, and its run."""


def add_actions(parser: argparse.ArgumentParser, actions: Sequence[Action]) -> None:
    """The actions as subcommands of ``parser``'s command, each with the common options too."""
    subparsers = parser.add_subparsers(
        dest="action", metavar="ACTION", required=True, parser_class=type(parser)
    )
    for name, helptext, add, run in actions:
        sub = subparsers.add_parser(name, help=helptext, description=helptext)
        add_common(sub, nested=True)
        add(sub)
        sub.set_defaults(run=run)


def parse_duration(text: str | None, option: str) -> timedelta | None:
    """``text`` given to ``option`` as a duration (None if not given); a UsageError if bad."""
    if text is None:
        return None
    if option == "--retention" and text.strip().lower() in durations.FOREVER:
        raise UsageError(
            f"--retention {text!r}: a pruner needs a finite window; to keep one consumer's "
            "records forever, give it --window NAME=forever (or choose the others with --consumer)"
        )
    try:
        return durations.parse(text, option)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None


def parse_windows(entries: list[str] | None) -> dict[str, timedelta | None]:
    """The ``--window NAME=DURATION`` entries by consumer; None for ``forever``."""
    windows: dict[str, timedelta | None] = {}
    for entry in entries or []:
        name, _, text = entry.partition("=")
        if not name.strip() or not text:
            raise UsageError(f"--window {entry!r}: expected NAME=DURATION, e.g. ledger=30d")
        forever = text.strip().lower() in durations.FOREVER
        windows[name.strip()] = (
            None if forever else parse_duration(text, f"--window {name.strip()}")
        )
    return windows


def parse_url(raw: str | None, secrets: Secrets) -> URL:
    """The URL from --db or the environment, validated; bare postgresql gets psycopg 3."""
    if not raw:
        raise UsageError(f"no database: pass --db URL or set {ENV_URL}")
    try:
        url = make_url(raw)
    except (ArgumentError, ValueError):  # their messages and tracebacks show the raw URL
        raise UsageError(
            "could not parse the database URL; expected e.g. "
            "postgresql://user@host:5432/db or sqlite:///path/to/file.db"
        ) from None
    secrets.add_url(raw, url)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    if url.drivername in ("mysql", "mariadb"):  # SQLAlchemy's default is mysqlclient
        url = url.set(drivername=f"{url.drivername}+pymysql")
    if url.get_backend_name() not in SUPPORTED:
        raise UsageError(
            f"unsupported database {url.get_backend_name()!r}: "
            f"supported are {', '.join(SUPPORTED)} ({supported_drivers()})"
        )
    check_address(url)
    return url


def check_address(url: URL) -> None:
    """UsageError for a database URL that parses but cannot name a server: a port out of
    range, an unescaped @ in the password (it ends up in the host). Never quotes the URL."""
    if url.port is not None and not 0 < url.port < 65536:
        raise UsageError(f"the database URL's port must be 1 to 65535, got {url.port}")
    if url.host and any(c in url.host for c in "@/ "):
        raise UsageError(
            "the database URL's host holds '@', '/' or a space: percent-encode them in the "
            "user and password (@ as %40, / as %2F)"
        )


def open_tables(args: argparse.Namespace) -> Tables:
    """The tables the options name (a usage error if a name is not a table name)."""
    try:
        return Tables.define(
            args.processed_events_table,
            args.outbox_table,
            partitioned=getattr(args, "partitioned", False),
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None


def open_database(args: argparse.Namespace) -> tuple[URL, Engine, Tables]:
    """The URL, an engine and the tables the options name; the engine connects when first used."""
    tables = open_tables(args)
    url = parse_url(args.db, args.secrets)
    log.debug("database %s, tables %s", shown(url), table_names(tables.all))
    try:
        return url, create_engine(url), tables
    except (NoSuchModuleError, ImportError) as error:
        raise UsageError(f"no driver for {url.drivername!r}: {describe(error)}") from error
    except ArgumentError as error:  # SQLAlchemy's dialect refuses the URL's form
        raise UsageError(f"invalid database URL: {describe(error)}") from None


def open_reading(
    args: argparse.Namespace, table: Callable[[Tables], Table]
) -> tuple[URL, Engine, Tables]:
    """open_database, then a CommandError unless ``table(tables)``, the one the command
    reads, exists."""
    url, engine, tables = open_database(args)
    read = table(tables)
    if read in missing_tables(engine, tables):
        raise CommandError(f"table {read.fullname} not found; run `{PROG} init-db` first")
    return url, engine, tables


def missing_tables(engine: Engine, tables: Tables) -> list[Table]:
    with engine.connect() as conn:
        inspector = inspect(conn)
        return [t for t in tables.all if not inspector.has_table(t.name, schema=t.schema)]


def require_tables(engine: Engine, tables: Tables) -> None:
    """CommandError naming the tables that are missing, if any."""
    if missing := missing_tables(engine, tables):
        raise CommandError(
            f"table(s) not found: {table_names(missing)}; run `{PROG} init-db` first"
        )


def table_names(tables: Sequence[Table]) -> str:
    return ", ".join(t.fullname for t in tables)
