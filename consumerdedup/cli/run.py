"""``consumerdedup run MODULE:APP``: a service's consumers, relay and pruner, in production.

``--workers N`` children under a supervisor that restarts the ones that die;
SIGTERM/SIGINT finishes the batches in flight and exits 0 within
``--shutdown-timeout``, a second signal exits at once; ``/livez``, ``/readyz`` and
``/metrics`` on ``--health-port``; ``--only NAME`` runs some parts; ``--check`` runs
the start and doctor checks of what the app declares and exits 0/1. Every option
also comes from its ``CONSUMERDEDUP_*`` variable or ``--env-file``: a flag beats the
environment, which beats the default. Bad input is one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError
from ..startup import FAIL
from .common import CommandError, UsageError

if TYPE_CHECKING:
    from ..app.loading import ServiceApp

NAME = "run"
HELP = "run a service's consumers, relay and pruner (MODULE:APP) under a supervisor"

log = logging.getLogger("consumerdedup.run")

SETTINGS_FLAGS = ("workers", "shutdown_timeout", "health_port", "log_level", "log_format",
                  "log_config", "liveness_timeout", "admin_port", "admin_host")  # fmt: skip
"""Flags that are also settings (``CONSUMERDEDUP_<NAME>``): a flag given beats them."""
DEFAULTS: dict[str, Any] = {"workers": 1, "shutdown_timeout": 30.0, "health_port": None,
                            "log_level": "INFO", "log_format": "text", "log_config": None,
                            "liveness_timeout": 60.0, "admin_port": None,
                            "admin_host": "127.0.0.1"}  # fmt: skip
"""Used where the Settings object has no such field."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "app", metavar="MODULE:APP", help="the App object, e.g. payments_service:app"
    )
    parser.add_argument("--workers", type=int, metavar="N", help="child processes (1)")
    parser.add_argument(
        "--only", action="append", metavar="NAME", help="run this part only (repeatable)"
    )
    parser.add_argument(
        "--check", action="store_true",
        help="run the start and doctor checks of what the app declares, print them, exit 0/1",
    )  # fmt: skip
    parser.add_argument(
        "--health-port",
        type=int,
        metavar="PORT",
        help="serve /livez /readyz /metrics on this port (0: any free one)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="SECONDS",
        help="longest a stop waits for the batches in flight (30)",
    )
    parser.add_argument(
        "--liveness-timeout",
        type=float,
        metavar="SECONDS",
        help="a part whose loop has not turned for this long fails /livez (60)",
    )
    parser.add_argument(
        "--admin-port",
        type=int,
        metavar="PORT",
        help="serve the admin pages (app.admin(...)) on this port (0: any free one)",
    )
    parser.add_argument(
        "--admin-host", metavar="HOST", help="the admin pages' bind address (127.0.0.1)"
    )
    parser.add_argument("--log-level", metavar="LEVEL", help="DEBUG, INFO (default), WARNING...")
    parser.add_argument("--log-format", metavar="FORMAT", help="text (default) or json")
    parser.add_argument("--log-config", metavar="FILE", help="a logging dictConfig (JSON/YAML)")
    parser.add_argument("--env-file", metavar="FILE", help="CONSUMERDEDUP_* settings from a file")
    parser.add_argument(
        "--reload",
        action="store_true",
        help="restart on a change of the source (development; one worker)",
    )


class Options:
    """The settings and the flags, merged: a flag given beats the Settings' value."""

    def __init__(self, args: argparse.Namespace) -> None:
        given = {name: getattr(args, name) for name in SETTINGS_FLAGS}
        given = {name: value for name, value in given.items() if value is not None}
        fields = self._fields()
        self.overrides = {k: v for k, v in given.items() if fields is None or k in fields}
        for port in ("health_port", "admin_port"):
            if given.get(port) == 0:  # any free port: the flag's alone, not a setting
                self.overrides.pop(port, None)
        if args.env_file and not Path(args.env_file).is_file():
            raise UsageError(f"--env-file {args.env_file}: no such file")
        from ..app.loading import load_settings

        try:
            self.settings = load_settings(args.env_file, self.overrides)
        except ConfigurationError as error:  # named as the user wrote it: the flag
            raise UsageError(_flag_named(str(error))) from None
        self._given = given
        for value in _secrets(self.settings):
            args.secrets.add_url(value)

    @staticmethod
    def _fields() -> set[str] | None:
        try:
            from ..app.settings import Settings  # type: ignore[import-not-found,unused-ignore]
        except ImportError:
            return None
        return set(getattr(Settings, "model_fields", {})) or None

    def __getattr__(self, name: str) -> Any:
        if name in self._given:
            return self._given[name]
        return getattr(self.settings, name, DEFAULTS.get(name))


def _flag_named(text: str) -> str:
    """Settings say ``Settings.load(workers=...)`` of a value given in code: here a flag."""
    return re.sub(r"Settings\.load\((\w+)=\.\.\.\)", lambda m: "--" + m[1].replace("_", "-"), text)


def _secrets(settings: object) -> list[str]:
    values = getattr(settings, "__dict__", {}).values()
    return [v.get_secret_value() for v in values if hasattr(v, "get_secret_value") and v]


def run(args: argparse.Namespace) -> int:
    # Imported here: the other commands do not pay for the App's imports (pydantic).
    from ..app import logs
    from ..app.loading import check_only, load_app

    options = Options(args)
    try:
        app = load_app(args.app)
        check_only(app, args.only)
    except ConfigurationError as error:  # chained: --verbose shows the import's traceback
        raise UsageError(str(error)) from error
    admin = _admin(app, options)
    if args.check:
        if admin is not None:
            admin.stop()
        return check(app, options, args)
    workers = int(options.workers)
    if args.reload and workers > 1:
        raise UsageError(f"--reload runs one worker; got --workers {workers} (drop one of them)")
    level = "DEBUG" if args.verbose else str(options.log_level)
    try:
        logs.configure(level, str(options.log_format), options.log_config, args.secrets.scrub)
    except ConfigurationError as error:
        raise UsageError(str(error)) from None
    from ..app.serving import Plan, serve

    plan = Plan(
        app=args.app, workers=workers, only=args.only, env_file=args.env_file,
        overrides=options.overrides, shutdown_timeout=float(options.shutdown_timeout),
        liveness_timeout=float(options.liveness_timeout), health_port=options.health_port,
        log_level=level, log_format=str(options.log_format), log_config=options.log_config,
        verbose=args.verbose, reload=args.reload, admin=admin,
    )  # fmt: skip
    try:
        outcome = serve(plan)
    except ConfigurationError as error:  # the health port taken, --reload without watchfiles
        raise CommandError(str(error)) from None
    if outcome.code:
        raise CommandError(outcome.error or "the worker stopped on an error")
    return 0


def _admin(app: ServiceApp, options: Options) -> Any:
    """The admin pages' server when a port is set (not started), checked as the rest is."""
    from ..app.admin_page import admin_server

    try:
        return admin_server(app, options.settings, options.admin_port, str(options.admin_host))
    except ConfigurationError as error:
        raise UsageError(_flag_named(str(error))) from None


def check(app: ServiceApp, options: Options, args: argparse.Namespace) -> int:
    """Print each check of what the app declares (ok / warn / FAIL, with its fix)."""
    found = list(app.check(options.settings, args.only))
    scrub = args.secrets.scrub
    width = max((len(str(c.name)) for c in found), default=10)
    for c in found:
        print(scrub(f"{c.status:<5} {c.name:<{width}} {c.detail}"), flush=True)
        if c.fix and c.status != "ok":
            print(scrub(f"{'':<5} {'':<{width}} fix: {c.fix}"))
    failing = sum(c.status == FAIL for c in found)
    print(f"{len(found)} check(s), {failing} failing" if found else "nothing to check")
    return 1 if failing else 0
