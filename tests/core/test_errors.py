"""errors.py is the root of the vocabulary: it imports nothing, and its docstring draws
every class it defines, each under the class it derives from."""

from __future__ import annotations

import ast
import inspect
import re

import pytest

import consumerdedup
from consumerdedup import errors

TREE_LINE = re.compile(r"^(?P<indent>[ |]*?)(?:\+-- )?(?P<name>[A-Z]\w+)\b")


def drawn_tree() -> dict[str, str | None]:
    """Each name in the docstring's tree -> the name drawn as its parent."""
    doc = errors.__doc__ or ""
    block = doc.split("::\n", 1)[1].strip("\n").split("\n\n", 1)[0]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        found = TREE_LINE.match(line)
        assert found, f"not a tree line: {line!r}"
        depth = len(found["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[found["name"]] = stack[-1][1] if stack else None
        stack.append((depth, found["name"]))
    return parents


def defined_classes() -> dict[str, type]:
    return {
        name: value
        for name, value in vars(errors).items()
        if inspect.isclass(value) and value.__module__ == errors.__name__
    }


def test_errors_imports_nothing() -> None:
    """Not sqlalchemy (describe lives in consumerdedup.reasons), nor anything else."""
    tree = ast.parse(inspect.getsource(errors))
    imports = [
        node.module if isinstance(node, ast.ImportFrom) else ", ".join(a.name for a in node.names)
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    assert imports == ["__future__"]


def test_the_tree_draws_every_class_under_its_base() -> None:
    parents = drawn_tree()
    classes = defined_classes()
    assert set(parents) - {"Exception", "BaseException"} == set(classes)
    for name, cls in classes.items():
        parent = parents[name]
        assert parent is not None and parent in {b.__name__ for b in cls.__bases__}, (
            f"{name} is drawn under {parent}, but derives from {cls.__bases__}"
        )


def test_every_error_is_exported() -> None:
    assert set(defined_classes()) <= set(consumerdedup.__all__)


def test_configuration_mistakes_raise_configuration_error() -> None:
    """Not a bare TypeError or ValueError; still a ValueError, as every ConfigurationError."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from consumerdedup import AsyncDeduplicator, ConfigurationError, Message
    from consumerdedup.testing import MemoryBroker

    def plain(message: Message, session: object) -> None:
        pass

    engine = create_async_engine("sqlite+aiosqlite://")
    with pytest.raises(ConfigurationError, match="must be an async def function"):
        AsyncDeduplicator(engine, "c").handler(plain)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="duplicate_rate") as caught:
        MemoryBroker(duplicate_rate=1.5)
    assert isinstance(caught.value, ValueError)
