"""The validators every public constructor checks its options with (Invariant 10).

Each takes the value as given and the option's name as the user wrote it
(``"RelayConfig.delete_published"``), and returns the value in its one accepted
form or raises a ``ConfigurationError`` that names the option, what was given
and what is expected. They never coerce: ``"no"`` is not a bool, ``True`` is
not an int, ``"payments"`` is not a list of seven names, a number is a
duration only where the option is documented in seconds.

A frozen dataclass stores the normalised value with ``settle``::

    def __post_init__(self) -> None:
        settle(self, "batch_size", integer(self.batch_size, "RelayConfig.batch_size", at_least=1))
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from .errors import ConfigurationError

T = TypeVar("T")

_SHOWN = 80
"""Longest repr of a given value quoted in an error; the rest is elided."""


def shown(value: object) -> str:
    """The given value as an error quotes it: its repr, cut short, with its type."""
    text = repr(value)
    if len(text) > _SHOWN:
        text = text[: _SHOWN - 3] + "..."
    return f"{text} ({type(value).__name__})"


def refuse(
    option: str, value: object, expected: str, *, secret: bool = False
) -> ConfigurationError:
    """The error for ``option`` given ``value``; a secret's value is never quoted."""
    given = f"a value not shown ({type(value).__name__})" if secret else shown(value)
    return ConfigurationError(f"{option}: expected {expected}, got {given}")


def settle(instance: object, name: str, value: object) -> None:
    """Store a normalised value on a frozen dataclass from its __post_init__."""
    object.__setattr__(instance, name, value)


def boolean(value: object, option: str) -> bool:
    """True or False only: no strings, no 0/1, no None."""
    if not isinstance(value, bool):
        raise refuse(option, value, "True or False")
    return value


LARGEST_INTEGER = 2**63 - 1
"""The largest integer any option takes unless it names a tighter bound: a bigint. A larger
one went into a statement (a LIMIT, a comparison with a count) and broke it at first use
with the driver's "bigint out of range" (``RelayConfig(batch_size=10**30)``)."""


def integer(
    value: object, option: str, *, at_least: int | None = None, at_most: int | None = None
) -> int:
    """An int (never a bool, a float or a numeric string) within the bounds given (at most
    LARGEST_INTEGER where no tighter bound is given)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise refuse(option, value, _int_range(at_least, at_most))
    if (at_least is not None and value < at_least) or (at_most is not None and value > at_most):
        raise refuse(option, value, _int_range(at_least, at_most))
    if at_most is None and value > LARGEST_INTEGER:
        raise refuse(option, value, _int_range(at_least, LARGEST_INTEGER))
    return value


def _int_range(at_least: int | None, at_most: int | None) -> str:
    if at_least is not None and at_most is not None:
        return f"an integer from {at_least} to {at_most}"
    if at_least is not None:
        return f"an integer >= {at_least}"
    if at_most is not None:
        return f"an integer <= {at_most}"
    return "an integer"


def number(
    value: object, option: str, *, above: float | None = None, at_least: float | None = None
) -> float:
    """A finite int or float (never a bool or a string), above or at least a bound."""
    expected = "a finite number"
    if above is not None:
        expected += f" > {above:g}"
    if at_least is not None:
        expected += f" >= {at_least:g}"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise refuse(option, value, expected)
    if not math.isfinite(value):
        raise refuse(option, value, expected)
    if (above is not None and value <= above) or (at_least is not None and value < at_least):
        raise refuse(option, value, expected)
    return float(value)


LONGEST_DURATION = timedelta(days=36500)
"""The longest duration any option takes unless it names a tighter bound: a century. A
longer one overflows the clocks that wait for it (threading's and time.sleep's limit is
292 years) or a datetime it is added to: accepted, it broke at the first wait
(``RetryPolicy(max_delay=timedelta.max)``: OverflowError at a message's first failure)."""


def duration(
    value: object,
    option: str,
    *,
    seconds: bool = False,
    at_least: timedelta | None = None,
    at_most: timedelta | None = None,
    zero: bool = False,
    note: str = "",
) -> timedelta:
    """A ``timedelta`` (or, where ``seconds`` says the option is documented so, a number of
    seconds), positive unless ``zero`` allows 0, within the bounds given; ``note`` is said
    after what is expected (``"or None to keep records forever"``)."""
    expected = "a timedelta" + (" or a number of seconds" if seconds else "")
    floor = at_least if at_least is not None else timedelta(0)
    bounds = f" >= {floor}" if (zero or at_least is not None) else " > 0"
    if at_most is not None:
        bounds += f" and <= {at_most}"
    if note:
        bounds += f", {note}"
    if isinstance(value, timedelta):
        span = value
    elif seconds and not isinstance(value, bool) and isinstance(value, int | float):
        if not math.isfinite(value):
            raise refuse(option, value, expected + bounds)
        try:
            span = timedelta(seconds=value)
        except OverflowError:
            raise refuse(option, value, expected + bounds) from None
    else:
        raise refuse(option, value, expected + bounds)
    too_small = span < floor if (zero or at_least is not None) else span <= timedelta(0)
    if too_small or (at_most is not None and span > at_most):
        raise refuse(option, value, expected + bounds)
    if at_most is None and span > LONGEST_DURATION:
        raise refuse(option, value, f"{expected} of at most {LONGEST_DURATION.days} days")
    return span


def text(
    value: object,
    option: str,
    *,
    empty: bool = False,
    max_length: int | None = None,
    secret: bool = False,
) -> str:
    """A str (never bytes), non-empty unless ``empty``, no NUL, at most ``max_length``;
    ``secret`` (a URL with its password, a token): never quoted in the error."""
    expected = "a string" if empty else "a non-empty string"
    if max_length is not None:
        expected += f" of at most {max_length} characters"
    if not isinstance(value, str) or "\x00" in value:
        raise refuse(option, value, expected + " without NUL", secret=secret)
    if (not empty and not value.strip()) or (max_length is not None and len(value) > max_length):
        raise refuse(option, value, expected, secret=secret)
    try:  # a lone surrogate: no database, broker or log can take it (it broke at first use)
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise refuse(option, value, expected + " of valid Unicode", secret=secret) from None
    return value


def names(
    value: object,
    option: str,
    *,
    empty: bool = False,
    each: Callable[[object, str], str] | None = None,
) -> tuple[str, ...]:
    """One name or a collection of names, as a tuple. A str is ONE name, never a list of its
    characters; a mapping, bytes or a non-string element is refused; ``each`` checks every
    name further (e.g. a topic's syntax)."""
    check = each or (lambda item, what: text(item, what))
    if isinstance(value, str):
        return (check(value, option),)
    if isinstance(value, Mapping | bytes | bytearray) or not isinstance(value, Iterable):
        raise refuse(option, value, "a name or a list of names")
    items = tuple(value)
    if not items and not empty:
        raise refuse(option, value, "at least one name")
    return tuple(check(item, f"{option}[{index}]") for index, item in enumerate(items))


def integers(
    value: object, option: str, *, at_least: int | None = None, at_most: int | None = None
) -> frozenset[int]:
    """One int or a collection of ints (each as ``integer`` takes it), as a frozenset. A str,
    bytes or a mapping is refused, never read as a list of its characters or keys."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = (value,)
    if isinstance(value, str | bytes | bytearray | Mapping) or not isinstance(value, Iterable):
        raise refuse(option, value, _int_range(at_least, at_most) + " or a collection of them")
    return frozenset(
        integer(item, f"{option}[{index}]", at_least=at_least, at_most=at_most)
        for index, item in enumerate(value)
    )


def mapping(
    value: object,
    option: str,
    *,
    keys: Callable[[object, str], str] | None = None,
    allowed: Collection[str] | None = None,
    allowed_are: str = "a known option",
) -> dict[str, Any]:
    """A mapping with str keys (``keys`` checks each further; with ``allowed``, each must be
    one of them, said as ``allowed_are``), as a new dict: the caller's may change later."""
    if not isinstance(value, Mapping):
        raise refuse(option, value, "a mapping (dict) of names to values")
    check = keys or (lambda item, what: text(item, what))
    found = {check(key, f"{option} key"): item for key, item in value.items()}
    for key in found:
        if allowed is not None and key not in allowed:
            raise refuse(f"{option} key", key, allowed_are)
    return found


def matching(value: object, option: str, pattern: re.Pattern[str], expected: str) -> str:
    """A str the whole of which ``pattern`` matches (a name with a syntax: a Kafka topic)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise refuse(option, value, expected)
    return value


def kinds(
    value: object, option: str, base: type[BaseException] = BaseException
) -> tuple[type[BaseException], ...]:
    """One exception class or a collection of them, as a tuple (``except`` takes that)."""
    expected = f"a {base.__name__} subclass or a tuple of them"
    if isinstance(value, type):
        value = (value,)
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise refuse(option, value, expected)
    items = tuple(value)
    for index, item in enumerate(items):
        if not isinstance(item, type) or not issubclass(item, base):
            raise refuse(f"{option}[{index}]", item, expected)
    return items


def function(
    value: object, option: str, expected: str = "a callable", *, blocking: bool = False
) -> Callable[..., Any]:
    """A callable (a function, a bound method, a class, an object with __call__); with
    ``blocking``, not an ``async def``: the option is called without await, so its coroutine
    would never run (an async dead_letter on a Deduplicator sent nothing, silently)."""
    if not callable(value):
        raise refuse(option, value, expected)
    if blocking and asynchronous(value):
        raise refuse(
            option, value, f"{expected}, a plain def (it is called without await: an async "
            "def's coroutine would never run)",
        )  # fmt: skip
    return value


def asynchronous(value: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one (partials seen
    through)."""
    while isinstance(value, functools.partial):
        value = value.func
    call = value if inspect.isfunction(value) or inspect.ismethod(value) else None
    if call is None and not isinstance(value, type):
        call = getattr(type(value), "__call__", None)  # noqa: B004 - the method itself
    return call is not None and inspect.iscoroutinefunction(call)


def functions(
    value: object, option: str, expected: str = "a callable", *, blocking: bool = False
) -> tuple[Callable[..., Any], ...]:
    """One callable or a collection of them, as a tuple (a str or a mapping is refused);
    ``blocking`` as ``function`` takes it."""
    if callable(value) and not isinstance(value, type):
        return (function(value, option, expected, blocking=blocking),)
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise refuse(option, value, f"{expected} or a list of them")
    items = tuple(value)
    for index, item in enumerate(items):
        function(item, f"{option}[{index}]", expected, blocking=blocking)
    return items


def instance(value: object, option: str, kind: type[T] | tuple[type[T], ...], expected: str) -> T:
    """An instance of ``kind`` (a bool is never taken where an int is meant: check it first)."""
    if not isinstance(value, kind):
        raise refuse(option, value, expected)
    return value


def maybe(
    value: object, option: str, check: Callable[..., T], *args: Any, **kwargs: Any
) -> T | None:
    """None as given (where None means "not set"), else ``check(value, option, ...)``."""
    return None if value is None else check(value, option, *args, **kwargs)


def choice(value: object, option: str, choices: Collection[T]) -> T:
    """One of ``choices``, compared exactly (no case folding: say so in the docs if wanted)."""
    for item in choices:
        if type(item) is type(value) and item == value:
            return item
    raise refuse(option, value, "one of " + ", ".join(repr(item) for item in choices))
