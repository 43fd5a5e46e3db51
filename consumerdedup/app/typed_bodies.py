"""Typed message bodies: a handler whose message parameter is annotated with a pydantic
model or a dataclass is given the body parsed and validated, not the Message.

A body that does not validate is that message's permanent failure (``InvalidBody``, a
DecodeError): FAILED, dead-lettered with the validation errors, never the worker's
crash. The errors name the fields and what was wrong, never the values given (a body
may carry what must not reach a log or a dead-letter header). In a bulk handler
(``list[Model]``) the one that does not validate fails alone.

The handler's shape is checked when it is declared: ``(message, session)``, or
``(messages, session)`` for a bulk one; anything else is a ConfigurationError naming
the handler and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel, PydanticUserError, TypeAdapter, ValidationError

from ..dedup.handler_kinds import kind
from ..errors import BatchMessageFailed, ConfigurationError, DecodeError
from ..message import Message

_LISTS = (list, Sequence, typing.Sequence, tuple)
_MAX_ERRORS = 5


class InvalidBody(DecodeError):
    """The body does not validate as the handler's model: permanent, dead-lettered."""


def where(fn: Any) -> str:
    """How a handler is named in errors: ``module.qualname``."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else name


def _model_of(annotation: Any) -> tuple[Any, bool]:
    """(the model, annotated as a list of it) if ``annotation`` is typed; (None, False)."""
    origin = typing.get_origin(annotation)
    if origin in _LISTS:
        args = typing.get_args(annotation)
        inner = args[0] if args else None
        return (inner, True) if _is_model(inner) else (None, False)
    return (annotation, False) if _is_model(annotation) else (None, False)


def _is_model(annotation: Any) -> bool:
    if not isinstance(annotation, type) or annotation is Message:
        return False
    return issubclass(annotation, BaseModel) or dataclasses.is_dataclass(annotation)


def check_signature(fn: Any, *, bulk: bool, consumer: str) -> None:
    """ConfigurationError unless ``fn`` can be called as ``fn(message, session)``."""
    what = f"handler {where(fn)} of consumer {consumer!r}"
    shape = "(messages, session)" if bulk else "(message, session)"
    if not callable(fn):
        raise ConfigurationError(f"{what}: expected a function taking {shape}, got {fn!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its call will say
    positional = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in signature.parameters.values())
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [
        p for p in signature.parameters.values() if p.default is p.empty and p.kind not in variadic
    ]
    extra = [p.name for p in required[2:]]
    if (len(positional) < 2 and not varargs) or extra:
        names = ", ".join(signature.parameters)
        raise ConfigurationError(
            f"{what} takes ({names}): a consumer's handler takes {shape}; "
            + ("give the others defaults" if extra else "add the missing parameter")
        )


def typed(fn: Any, *, bulk: bool, consumer: str) -> Any:
    """``fn`` itself if its message parameter is not typed, else a wrapper (of the same
    kind, blocking or async) that gives it the parsed body or bodies."""
    check_signature(fn, bulk=bulk, consumer=consumer)
    first = next(iter(inspect.signature(fn).parameters.values()), None)
    if first is None:
        return fn
    try:
        hints = typing.get_type_hints(fn)
    except Exception as error:  # an annotation naming what the module does not define
        raise ConfigurationError(
            f"handler {where(fn)} of consumer {consumer!r}: cannot resolve its annotations "
            f"({error}); import the model in the handler's module"
        ) from None
    model, many = _model_of(hints.get(first.name))
    if model is None:
        return fn
    if many != bulk:
        fix = "declare it with bulk=True" if many else "annotate it as list[...] "
        raise ConfigurationError(
            f"handler {where(fn)} of consumer {consumer!r}: its {first.name!r} is "
            + (
                "a list of bodies, but the consumer is not bulk"
                if many
                else "one body, but the consumer is bulk"
            )
            + f": {fix}"
        )
    what = f"handler {where(fn)} of consumer {consumer!r}"
    parse = _parser(model, what)
    wrapper = (
        _async_wrapper(fn, parse, bulk) if kind(fn) == "coroutine" else _wrapper(fn, parse, bulk)
    )
    wrapper.__consumerdedup_body_model__ = parse.complete
    return wrapper


def check_body_model(handler: Any) -> None:
    """ConfigurationError unless a typed handler's model can validate now (every type it
    names defined). Called when the App is built, after the service's module ran whole: a
    model may name a type its module defines below the handler, but one never defined
    failed every message, each recorded FAILED and dead-lettered for a setup fault."""
    complete = getattr(handler, "__consumerdedup_body_model__", None)
    if complete is not None:
        complete()


class _Parser:
    """The body's parser, and the check that its model is whole."""

    def __init__(self, adapter: TypeAdapter[Any], name: str, what: str) -> None:
        self.adapter, self.name, self.what = adapter, name, what

    def __call__(self, message: Message) -> Any:
        try:
            return self.adapter.validate_json(message.body)
        except ValidationError as error:
            raise InvalidBody(f"body does not validate as {self.name}: {_errors(error)}") from None

    def complete(self) -> None:
        if self.adapter.pydantic_complete:
            return
        try:
            self.adapter.rebuild(raise_errors=True)
        except (PydanticUserError, NameError) as error:  # PydanticUndefinedAnnotation
            raise ConfigurationError(
                f"{self.what}: its body model {self.name} is not fully defined "
                f"({type(error).__name__}: {str(error).splitlines()[0]}); define every type "
                "it names in its module, or import it there"
            ) from None


def _parser(model: Any, what: str) -> _Parser:
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(model)
    except PydanticUserError as error:  # PydanticSchemaGenerationError: a type pydantic lacks
        raise ConfigurationError(
            f"{what}: pydantic cannot validate its body model {model.__name__} "
            f"({type(error).__name__}: {str(error).splitlines()[0]}); give it fields of types "
            "pydantic knows, or take the Message and parse the body yourself"
        ) from None
    return _Parser(adapter, model.__name__, what)


def _errors(error: ValidationError) -> str:
    """The fields and what is wrong with each; never the input values."""
    found = error.errors(include_url=False, include_context=False, include_input=False)
    said = [
        f"{'.'.join(str(part) for part in problem['loc']) or 'body'}: {problem['msg']}"
        for problem in found[:_MAX_ERRORS]
    ]
    more = len(found) - _MAX_ERRORS
    return "; ".join(said) + (f" (and {more} more)" if more > 0 else "")


def _bodies(parse: Callable[[Message], Any], messages: Sequence[Message]) -> list[Any]:
    bodies = []
    for message in messages:
        try:
            bodies.append(parse(message))
        except InvalidBody as error:
            raise BatchMessageFailed(message, error) from error  # it alone fails
    return bodies


def _wrapper(fn: Any, parse: Callable[[Message], Any], bulk: bool) -> Any:
    @functools.wraps(fn)
    def handle(message: Any, session: Any) -> Any:
        body = _bodies(parse, message) if bulk else parse(message)
        return fn(body, session)

    return handle


def _async_wrapper(fn: Any, parse: Callable[[Message], Any], bulk: bool) -> Any:
    @functools.wraps(fn)
    async def handle(message: Any, session: Any) -> Any:
        body = _bodies(parse, message) if bulk else parse(message)
        return await fn(body, session)

    return handle
