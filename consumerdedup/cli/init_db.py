"""``consumerdedup init-db``: create the tables (idempotent), or print their DDL with ``--sql``."""

from __future__ import annotations

import argparse
import sys

from ..errors import ConfigurationError
from ..schema import SchemaLocked, ddl, install
from .common import CommandError, missing_tables, open_database, table_names
from .redact import shown

NAME = "init-db"
HELP = "create the tables (idempotent)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sql", action="store_true", help="print the DDL instead; needs no database"
    )
    parser.add_argument(
        "--partitioned",
        action="store_true",
        help="PostgreSQL: processed_events range-partitioned by day, so pruning drops whole days "
        "(consumers must then use Tables.define(partitioned=True))",
    )


def run(args: argparse.Namespace) -> int:
    url, engine, tables = open_database(args)
    try:
        if args.sql:
            sys.stdout.write(ddl(engine, tables))
            return 0
        missing = missing_tables(engine, tables)
        install(engine, tables)
    except (ConfigurationError, SchemaLocked) as error:  # --partitioned on SQLite or on a
        # plain table; a change (a dropped index or trigger) whose table lock was not granted
        raise CommandError(str(error)) from None
    present = [t.fullname for t in tables.all if t not in missing]
    done = [f"created {table_names(missing)}"] if missing else []
    done += [f"already present: {', '.join(present)}"] if present else []
    print(f"{'; '.join(done)} ({shown(url)})")
    return 0
