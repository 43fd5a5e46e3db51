"""``consumerdedup init-db``: create the tables (idempotent), or print their DDL with ``--sql``."""

from __future__ import annotations

import argparse
import sys

from sqlalchemy import create_mock_engine, make_url

from ..errors import ConfigurationError
from ..schema import SchemaLocked, ddl, install
from ..schema.audit_table import admin_audit_table, audit_table_name, install_audit
from .common import (
    CommandError,
    UsageError,
    missing_tables,
    open_database,
    open_tables,
    table_names,
)
from .redact import shown

# Only a dialect's SQL compiler is used: a mock engine, which never connects.
DIALECTS = {"postgresql": "postgresql+psycopg://", "sqlite": "sqlite://"}
NAME = "init-db"
HELP = "create the tables (idempotent)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sql", action="store_true", help="print the DDL instead; connects to no database"
    )
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        help="with --sql: the SQL dialect to print, instead of --db's (then no --db is needed)",
    )
    parser.add_argument(
        "--partitioned",
        action="store_true",
        help="PostgreSQL: processed_events range-partitioned by day, so pruning drops whole days "
        "(consumers must then use Tables.define(partitioned=True))",
    )
    parser.add_argument(
        "--admin-audit",
        action="store_true",
        help="also the admin pages' audit table (admin_audit, for admin_app(audit='table'))",
    )


def run(args: argparse.Namespace) -> int:
    if args.dialect and not args.sql:
        raise UsageError("--dialect goes with --sql (init-db itself uses --db's database)")
    if args.sql and args.dialect:
        return _print_ddl(args)
    if args.sql and args.admin_audit:
        raise UsageError("--admin-audit creates the table; --sql prints the library's tables")
    url, engine, tables = open_database(args)
    try:
        if args.sql:
            sys.stdout.write(ddl(engine, tables))
            return 0
        missing = missing_tables(engine, tables)
        install(engine, tables)
        if args.admin_audit:
            audit = admin_audit_table(audit_table_name(tables.processed_events))
            install_audit(engine, audit)
    except (ConfigurationError, SchemaLocked) as error:  # --partitioned on SQLite or on a
        # plain table; a change (a dropped index or trigger) whose table lock was not granted
        raise CommandError(str(error)) from None
    present = [t.fullname for t in tables.all if t not in missing]
    done = [f"created {table_names(missing)}"] if missing else []
    done += [f"already present: {', '.join(present)}"] if present else []
    done += [f"admin audit table {audit.fullname} ready"] if args.admin_audit else []
    print(f"{'; '.join(done)} ({shown(url)})")
    return 0


def _print_ddl(args: argparse.Namespace) -> int:
    tables = open_tables(args)
    engine = create_mock_engine(make_url(DIALECTS[args.dialect]), lambda *a, **k: None)
    try:
        sys.stdout.write(ddl(engine, tables))  # type: ignore[arg-type]  # compiles only
    except ConfigurationError as error:  # --partitioned with --dialect sqlite
        raise UsageError(str(error)) from None
    return 0
