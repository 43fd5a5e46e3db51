"""help() on the public API reads as a signature: no default's repr runs past a line
(a Tables default printed every Column of three tables)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import consumerdedup
import consumerdedup.http
import consumerdedup.testing
from consumerdedup import Tables
from consumerdedup.schema import DEFAULT

LONGEST_DEFAULT = 60


def signatures(module: ModuleType) -> Iterator[tuple[str, inspect.Signature]]:
    """Every public callable of ``__all__``, and the public methods of its classes."""
    for name in module.__all__:
        value = getattr(module, name)
        members: list[tuple[str, Any]] = [(name, value)]
        if inspect.isclass(value):
            members += [
                (f"{name}.{attr}", getattr(member, "__func__", member))
                for attr, member in vars(value).items()
                if not attr.startswith("_") or attr == "__init__"
            ]
        for label, member in members:
            if callable(member):
                try:
                    yield label, inspect.signature(member)
                except (TypeError, ValueError):  # a builtin without one
                    continue


@pytest.mark.parametrize(
    "module", [consumerdedup, consumerdedup.http, consumerdedup.testing], ids=lambda m: m.__name__
)
def test_no_default_fills_the_screen(module: ModuleType) -> None:
    long = [
        f"{label}({parameter.name}={shown[:40]}...)"
        for label, signature in signatures(module)
        for parameter in signature.parameters.values()
        if parameter.default is not parameter.empty
        and len(shown := repr(parameter.default)) > LONGEST_DEFAULT
    ]
    assert not long


def test_tables_show_the_define_call_that_names_them() -> None:
    assert repr(DEFAULT) == "Tables.define()"
    assert "tables: 'Tables' = Tables.define()" in str(inspect.signature(consumerdedup.install))
    custom = Tables.define("app.events", "app.outbox", partitioned=True)
    assert repr(custom) == "Tables.define('app.events', 'app.outbox', partitioned=True)"
    keys = Tables.define(idempotency_keys="http.keys")
    assert repr(keys) == "Tables.define(idempotency_keys='http.keys')"
    versions = Tables.define("app.events", "app.outbox", version_table="app.v")
    assert repr(versions) == "Tables.define('app.events', 'app.outbox', version_table='app.v')"
