"""Which callables can be handlers: their call must run their body, or nothing is recorded.

Calling a generator function, an async generator function, or (from blocking
code) a coroutine function runs none of its body: it returns an object that
would run it later. A handler like that would be recorded PROCESSED with no
effect, and every redelivery answered DUPLICATE. Such handlers are refused
when they are wrapped, seen through ``functools.partial`` and through a
callable object's ``__call__``; and since a plain function can still return
such an object (a wrapper, a forgotten ``await``), each call's return value
is checked too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ..errors import ConfigurationError
from ..options import function


class HandlerNotRun(ConfigurationError):
    """A handler's call returned an object that would run its body later: a setup fault.

    Raised out of ``process_batch`` (the runner stops): nothing of that attempt
    commits, and no message is recorded for it.
    """


def _code_owner(fn: Any) -> Any:
    """What runs when ``fn`` is called: through partials, and a callable object's __call__."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if callable(fn) and not (
        inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn)
    ):
        call = vars(type(fn)).get("__call__") or getattr(type(fn), "__call__", None)  # noqa: B004
        if inspect.isfunction(call):
            return call
    return fn


def kind(fn: Any) -> str:
    """``generator``, ``async generator``, ``coroutine`` or ``function``."""
    for owner in (fn, _code_owner(fn)):
        if inspect.isasyncgenfunction(owner):
            return "async generator"
        if inspect.isgeneratorfunction(owner):
            return "generator"
        if inspect.iscoroutinefunction(owner):
            return "coroutine"
    return "function"


def require_blocking(fn: Any) -> None:
    """ConfigurationError unless calling ``fn`` runs its body (for Deduplicator)."""
    function(fn, "handler(fn)", "a function taking (message, session)")
    found = kind(fn)
    if found == "coroutine":
        raise ConfigurationError(
            f"{fn!r} is a coroutine function: wrap it with AsyncDeduplicator, not Deduplicator"
        )
    if found != "function":
        raise ConfigurationError(_not_run(fn, found, "a plain def function"))


def require_async(fn: Any) -> None:
    """ConfigurationError unless ``fn`` is a coroutine function (for AsyncDeduplicator)."""
    function(fn, "handler(fn)", "an async def function taking (message, session)")
    found = kind(fn)
    if found in ("generator", "async generator"):
        raise ConfigurationError(_not_run(fn, found, "an async def function without yield"))
    if found != "coroutine":
        raise ConfigurationError(f"{fn!r} must be an async def function taking (message, session)")


def check_returned(fn: Any, returned: Any) -> None:
    """After a blocking call: HandlerNotRun if it returned something that has not run yet."""
    if returned is None:  # what nearly every handler returns: nothing to look into
        return
    if inspect.isgenerator(returned) or inspect.iscoroutine(returned):
        returned.close()
    if (
        inspect.isawaitable(returned)
        or inspect.isgenerator(returned)
        or inspect.isasyncgen(returned)
        or _holds_unstarted(returned)
    ):
        raise HandlerNotRun(_returned(fn, returned))


def _holds_unstarted(returned: Any) -> bool:
    """An object holding a generator or coroutine whose body has not started: the handler
    returned its work wrapped (``@contextlib.contextmanager`` on the handler returns a
    context manager around the un-run generator). One level deep: the handler's own."""
    try:
        held = list(vars(returned).values())
    except TypeError:  # no __dict__: None, numbers, a driver's result
        return False
    for value in held:
        if inspect.isgenerator(value) and inspect.getgeneratorstate(value) == "GEN_CREATED":
            value.close()
            return True
        if inspect.iscoroutine(value) and inspect.getcoroutinestate(value) == "CORO_CREATED":
            value.close()
            return True
    return False


def check_awaitable(fn: Any, returned: Any) -> None:
    """Before awaiting an async handler's call: HandlerNotRun unless it can be awaited."""
    if inspect.isgenerator(returned):
        returned.close()
    if not inspect.isawaitable(returned):
        raise HandlerNotRun(_returned(fn, returned))


def check_awaited(fn: Any, result: Any) -> None:
    """After awaiting: HandlerNotRun if the result is itself un-run work (a missing await)."""
    check_returned(fn, result)


def _not_run(fn: Any, found: str, instead: str) -> str:
    return (
        f"{fn!r} is {'an' if found[0] == 'a' else 'a'} {found} function: calling it does not "
        f"run its body, so its message would be recorded without its effects; make it {instead}"
    )


def _returned(fn: Any, returned: Any) -> str:
    return (
        f"handler {fn!r} returned a {type(returned).__name__} instead of running: its body did "
        "not run (a generator, a coroutine that was never awaited, or a context manager "
        "around one), so its message is not recorded; make the handler run its work when "
        "called (remove yield or @contextmanager, add the missing await, or use the "
        "deduplicator of its kind)"
    )
