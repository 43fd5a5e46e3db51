"""``app.admin(...)``: every option checked where it is given (a ConfigurationError
naming it, never quoting a token), once per app."""

from __future__ import annotations

import pytest

from consumerdedup import App
from consumerdedup.admin import Role
from consumerdedup.errors import ConfigurationError


def test_the_options_are_checked_where_given() -> None:
    app = App("shop")
    cases = [
        ({"authorize": "ops"}, r"app.admin\(authorize=...\): expected a callable or None"),
        ({"audit": "tabel"}, r"app.admin\(audit=...\): expected a callable, 'table' or None"),
        ({"actions": "yes"}, r"app.admin\(actions=...\): expected True or False"),
        ({"port": 0}, r"app.admin\(port=...\)"),
        ({"port": "8090"}, r"app.admin\(port=...\)"),
        ({"token": "s3cret"}, r"app.admin\(token=...\): expected at least 16 characters"),
    ]
    for given, said in cases:
        with pytest.raises(ConfigurationError, match=said) as raised:
            app.admin(**given)
        assert "s3cret" not in str(raised.value)
    assert app.admin_declaration is None


def test_declared_once_with_the_audit_table() -> None:
    app = App("shop")
    app.admin(authorize=lambda request: Role.VIEWER, audit="table", port=8090)
    assert app.admin_declaration is not None and app.admin_declaration.audit == "table"
    with pytest.raises(ConfigurationError, match="declares its admin pages already"):
        app.admin(token="x" * 16)
    assert "admin" not in app.part_names  # not a part: no worker child serves it
