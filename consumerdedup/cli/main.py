"""The ``consumerdedup`` command: ``init-db``, ``stats``, ``demo``, ``prune`` and ``relay``.

Bad input is one line on stderr and exit 2 (usage) or 1 (runtime); a traceback
only with ``--verbose``. Passwords in URLs are never printed: URLs are shown
masked, and every error and log line has its passwords masked where they
stand (see redact.py); the URLs given travel as ``args.secrets``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, NoReturn

from sqlalchemy import Engine, Table, case, create_engine, func, inspect, select
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from ..db.partitions import DayPartitions
from ..errors import ConfigurationError, describe
from ..schema import Tables, ddl, install
from .redact import Secrets, shown

PROG = "consumerdedup"
ENV_URL = "CONSUMERDEDUP_DB_URL"
SUPPORTED = ("postgresql", "sqlite")

log = logging.getLogger(__name__)


class CommandError(Exception):
    """A failure reported as one line: exit 1 (runtime)."""

    code = 1


class UsageError(CommandError):
    """Bad input on the command line: exit 2."""

    code = 2


class _ScrubbingFormatter(logging.Formatter):
    def __init__(self, fmt: str, secrets: Secrets) -> None:
        super().__init__(fmt)
        self.secrets = secrets

    def format(self, record: logging.LogRecord) -> str:
        return self.secrets.scrub(super().format(record))


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


# --- database and tables -------------------------------------------------------------------


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
    if url.get_backend_name() not in SUPPORTED:
        raise UsageError(
            f"unsupported database {url.get_backend_name()!r}: "
            f"only {' and '.join(SUPPORTED)} are supported"
        )
    return url


def _setup(args: argparse.Namespace) -> tuple[URL, Engine, Tables]:
    """Validate the options; the engine does not connect until first used."""
    try:
        tables = Tables.define(
            args.processed_events_table,
            args.outbox_table,
            partitioned=getattr(args, "partitioned", False),
        )
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    url = parse_url(args.db, args.secrets)
    log.debug("database %s, tables %s", shown(url), _names(tables.all))
    try:
        return url, create_engine(url), tables
    except (NoSuchModuleError, ImportError) as error:
        raise UsageError(f"no driver for {url.drivername!r}: {describe(error)}") from error


def _missing(engine: Engine, tables: Tables) -> list[Table]:
    with engine.connect() as conn:
        inspector = inspect(conn)
        return [t for t in tables.all if not inspector.has_table(t.name, schema=t.schema)]


# --- commands ------------------------------------------------------------------------------


def cmd_init_db(args: argparse.Namespace) -> int:
    url, engine, tables = _setup(args)
    try:
        if args.sql:
            sys.stdout.write(ddl(engine, tables))
            return 0
        missing = _missing(engine, tables)
        install(engine, tables)
    except ConfigurationError as error:  # --partitioned on SQLite or on a plain table
        raise CommandError(str(error)) from None
    present = [t.fullname for t in tables.all if t not in missing]
    done = [f"created {_names(missing)}"] if missing else []
    done += [f"already present: {', '.join(present)}"] if present else []
    print(f"{'; '.join(done)} ({shown(url)})")
    return 0


def _names(tables: Sequence[Table]) -> str:
    return ", ".join(t.fullname for t in tables)


def _utc(value: datetime) -> datetime:
    """SQLite gives back naive datetimes; the library always writes UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _iso(value: datetime | None) -> str | None:
    return _utc(value).isoformat() if value is not None else None


def _count(condition: Any) -> Any:
    return func.coalesce(func.sum(case((condition, 1), else_=0)), 0)


def consumer_stats(engine: Engine, pe: Table) -> list[dict[str, Any]]:
    at = pe.c.processed_at
    query = (
        select(pe.c.consumer, _count(pe.c.outcome == "processed"), _count(pe.c.outcome == "failed"))
        .add_columns(func.min(at), func.max(at))
        .group_by(pe.c.consumer)
        .order_by(pe.c.consumer)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    keys = ("consumer", "processed", "failed", "oldest", "newest")
    return [
        dict(zip(keys, (c, int(p), int(f), _iso(lo), _iso(hi)), strict=True))
        for c, p, f, lo, hi in rows
    ]


def outbox_stats(engine: Engine, ob: Table) -> dict[str, Any]:
    pending = ob.c.published_at.is_(None)
    query = select(
        _count(pending),
        _count(~pending),
        _count(pending & (ob.c.attempts > 0)),
        func.min(case((pending, ob.c.created_at))),
    )
    with engine.connect() as conn:
        unpublished, published, failing, oldest = conn.execute(query).one()
    age = (datetime.now(UTC) - _utc(oldest)).total_seconds() if oldest is not None else None
    return {
        "unpublished": int(unpublished),
        "published": int(published),
        "failing": int(failing),
        "oldest_unpublished_age_seconds": None if age is None else round(age, 3),
    }


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(headers), *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def cmd_stats(args: argparse.Namespace) -> int:
    url, engine, tables = _setup(args)
    if missing := _missing(engine, tables):
        raise CommandError(f"table(s) not found: {_names(missing)}; run `{PROG} init-db` first")
    pe, ob = tables.processed_events, tables.outbox
    consumers, outbox = consumer_stats(engine, pe), outbox_stats(engine, ob)
    days = _partition_stats(engine, tables)
    if args.json:
        processed: dict[str, Any] = {"table": pe.fullname, "consumers": consumers}
        if days is not None:
            processed["partitioned"] = days
        report = {"processed_events": processed, "outbox": {"table": ob.fullname, **outbox}}
        print(json.dumps({"database": shown(url), **report}, indent=2))
        return 0
    rows = [list(c.values()) for c in consumers]
    headers = ["consumer", "processed", "failed", "oldest processed_at", "newest processed_at"]
    print(f"database: {shown(url)}\n\nprocessed events ({pe.fullname}):")
    print(_table(headers, rows) if rows else "(no records)")
    if days is not None:
        span = f", {days['oldest_from']} to {days['newest_to']}" if days["partitions"] else ""
        print(
            f"partitioned by day: {days['partitions']} partitions{span}; "
            f"{days['rows_in_default']:,} rows in DEFAULT"
            + (
                " (days not made in time: keep the pruner scheduled)"
                if days["rows_in_default"]
                else ""
            )
        )
    age = outbox["oldest_unpublished_age_seconds"]
    counts = [outbox[k] for k in ("unpublished", "published", "failing")]
    print(f"\noutbox ({ob.fullname}):")
    headers = ["unpublished", "published", "failing (attempts > 0)", "oldest unpublished age"]
    print(_table(headers, [[*counts, None if age is None else _duration(age)]]))
    return 0


def _partition_stats(engine: Engine, tables: Tables) -> dict[str, Any] | None:
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as conn:
        return DayPartitions(tables.processed_events).summary(conn)


def cmd_demo(args: argparse.Namespace) -> int:
    demo = importlib.import_module(f"{__package__}.demo")  # imported late: optional
    code: int = demo.run(sys.stdout)
    return code


# --- parsing and running -------------------------------------------------------------------


def _add_common(parser: argparse.ArgumentParser, *, nested: bool) -> None:
    """The shared options; a subcommand's defaults must not mask values given before it."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if nested else value

    group = parser.add_argument_group("common options")
    env_url = os.environ.get(ENV_URL)
    group.add_argument("--db", metavar="URL", default=default(env_url), help=f"or ${ENV_URL}")
    pe_default = default("processed_events")
    group.add_argument("--processed-events-table", metavar="NAME", default=pe_default)
    group.add_argument("--outbox-table", metavar="NAME", default=default("outbox"))
    verbose = "log at DEBUG; show tracebacks on errors"
    group.add_argument("--verbose", action="store_true", default=default(False), help=verbose)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Effectively-once message consumers: admin commands.")
    _add_common(parser, nested=False)
    commands = parser.add_subparsers(metavar="COMMAND", required=True, parser_class=_Parser)

    def command(name: str, run: Callable[[argparse.Namespace], int], text: str) -> Any:
        sub = commands.add_parser(name, help=text, description=text)
        _add_common(sub, nested=True)
        sub.set_defaults(run=run)
        return sub

    init = command("init-db", cmd_init_db, "create the tables (idempotent)")
    init.add_argument("--sql", action="store_true", help="print the DDL instead; needs no database")
    init.add_argument(
        "--partitioned",
        action="store_true",
        help="PostgreSQL: processed_events range-partitioned by day, so pruning drops whole days "
        "(consumers must then use Tables.define(partitioned=True))",
    )
    stats = command("stats", cmd_stats, "counts per consumer and of the outbox")
    stats.add_argument("--json", action="store_true", help="machine-readable output")
    command("demo", cmd_demo, "run the embedded demo (SQLite and an in-memory broker)")
    # prune lives in prune.py, imported here because it imports this module.
    from .prune import add_arguments, cmd_prune

    text = "delete dedup records older than retention + buffer, once or --every"
    add_arguments(command("prune", cmd_prune, text))
    from .relay import add_arguments as add_relay_arguments
    from .relay import cmd_relay

    text = "publish committed outbox rows to Kafka or RabbitMQ until SIGTERM (or --once)"
    add_relay_arguments(command("relay", cmd_relay, text))
    return parser


def _message(error: Exception) -> str:
    if isinstance(error, CommandError):
        return str(error)
    if isinstance(error, DBAPIError) and error.orig is not None:
        return f"database error: {describe(error.orig)}"
    return describe(error)


def _show_warning(
    message: Warning | str, category: type[Warning], *_: object, **__: object
) -> None:
    log.warning("%s: %s", category.__name__, message)  # one line, scrubbed by the formatter


def _setup_logging(verbose: bool, secrets: Secrets) -> None:
    handler = logging.StreamHandler(sys.stderr)
    detail = "%(asctime)s %(levelname)s %(name)s" if verbose else PROG + ": %(levelname)s"
    handler.setFormatter(_ScrubbingFormatter(detail + ": %(message)s", secrets))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    warnings.showwarning = _show_warning
    if verbose:  # SQLAlchemy quiets itself to WARNING; INFO shows the SQL it runs
        logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.secrets = secrets = Secrets()
    _setup_logging(args.verbose, secrets)
    try:
        code: int = args.run(args)
        return code
    except (Exception, KeyboardInterrupt) as error:
        if args.verbose:
            sys.stderr.write(secrets.scrub(traceback.format_exc()))
        text = "interrupted" if isinstance(error, KeyboardInterrupt) else _message(error)
        sys.stderr.write(f"{PROG}: error: {' '.join(secrets.scrub(text).split())}\n")
        if isinstance(error, KeyboardInterrupt):
            return 130
        return error.code if isinstance(error, CommandError) else 1
