"""``module:attribute`` to the App it names, or one line saying what is wrong and the fix.

The supervisor loads the app once to say a bad path before any child starts; each
child loads it again (a fresh interpreter), as ``uvicorn module:app`` does.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Collection, Sequence
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigurationError
from ..reasons import describe


@runtime_checkable
class ServiceApp(Protocol):
    """What the worker needs of an App (see /work/notes/app_interface.md, the seam)."""

    @property
    def part_names(self) -> Sequence[str]: ...

    def build(self, settings: Any, only: Collection[str] | None = None) -> Sequence[Any]: ...

    def check(self, settings: Any, only: Collection[str] | None = None) -> Sequence[Any]: ...


class AppNotFound(ConfigurationError):
    """The ``module:attribute`` given does not name an App: the command line's fault."""


def load_app(target: str) -> ServiceApp:
    """Import ``module`` (the current directory first on the path) and return ``attribute``."""
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise AppNotFound(
            f"{target!r}: expected MODULE:ATTRIBUTE, the module and the App in it, "
            "e.g. payments_service:app"
        )
    if os.getcwd() not in sys.path:  # `consumerdedup run svc:app` from the service's folder
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise AppNotFound(
                f"{target!r}: no module named {error.name!r} (run from the folder that holds "
                "it, or put it on PYTHONPATH)"
            ) from error
        raise AppNotFound(
            f"{target!r}: importing {module_name} failed: {describe(error)}"
        ) from error
    except Exception as error:
        raise AppNotFound(
            f"{target!r}: importing {module_name} failed: {describe(error)}"
        ) from error
    found: Any = module
    for name in attribute.split("."):
        try:
            found = getattr(found, name)
        except AttributeError:
            raise AppNotFound(
                f"{target!r}: module {module_name} has no attribute {attribute!r}; "
                f"name the App object it defines, e.g. {module_name}:app"
            ) from None
    if not is_app(found):
        raise AppNotFound(
            f"{target!r} is a {type(found).__name__}, not a consumerdedup App: name the "
            f"object made with consumerdedup.App(...), e.g. {module_name}:app"
        )
    return found  # type: ignore[no-any-return]


def is_app(found: object) -> bool:
    """An instance of consumerdedup's App when there is one, else anything with its methods."""
    try:
        app_module = importlib.import_module("consumerdedup.app.app")  # the App helper's
    except ImportError:
        app_class = None
    else:
        app_class = getattr(app_module, "App", None)
    if isinstance(app_class, type) and isinstance(found, app_class):
        return True
    return not isinstance(found, type) and isinstance(found, ServiceApp)


def check_only(app: ServiceApp, only: Collection[str] | None) -> None:
    """A ConfigurationError for an ``--only`` name the app has no part of."""
    names = list(app.part_names)
    for name in only or ():
        if name not in names:
            raise AppNotFound(
                f"--only {name!r}: the app has no part of that name; its parts: "
                f"{', '.join(names) or '(none)'}"
            )


def load_settings(env_file: str | None, overrides: dict[str, Any]) -> Any:
    """The App helper's Settings: explicit ``overrides`` (the flags given) beat the
    ``CONSUMERDEDUP_*`` environment and ``env_file``, which beat the defaults. A value that
    does not parse is a ConfigurationError naming the variable."""
    from .settings import Settings  # type: ignore[import-not-found,unused-ignore]

    return Settings.load(env_file, **overrides)
