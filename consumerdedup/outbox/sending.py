"""The relay's side of a publisher: entered once, driven from blocking code, left once."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from ..errors import ConfigurationError, DestinationMissing
from ..event_loop import OwnLoop, loop_running
from ..retry import ErrorKind, classify
from ..telemetry import hooks
from .publisher import AsyncPublisher, NotSent, Outcomes, Outgoing, Publisher, WindowPublisher

T = TypeVar("T")


class Sender:
    """Publishes through a Publisher or an AsyncPublisher from blocking code.

    The publisher's context is entered before the first publish and left by
    ``close()``. An AsyncPublisher runs on an event loop of the Sender's own
    (its client binds to that loop), so a thread that runs a loop already
    cannot drive it.
    """

    def __init__(self, publisher: Publisher | AsyncPublisher) -> None:
        if not isinstance(publisher, Publisher | AsyncPublisher):
            publisher = _adopted(publisher)
        self.publisher = publisher
        self.is_async = isinstance(publisher, AsyncPublisher)
        self.pipelines = isinstance(publisher, WindowPublisher)
        self._loop = OwnLoop()
        self._entered = False

    def check_thread(self) -> None:
        """ConfigurationError if an AsyncPublisher would have to run inside a running loop."""
        if self.is_async and loop_running():
            raise ConfigurationError(
                "OutboxRelay blocks: from asyncio code run it in a thread "
                "(await asyncio.to_thread(relay.run_once), or relay.run)"
            )

    def open(self) -> None:
        """Enter the publisher's context (start its producer, connect) if not entered yet.

        Before any row is claimed: what this raises is the publisher's own fault (an
        address, credentials, a feature the broker lacks), never an event's.
        """
        if self._entered:
            return
        publisher = self.publisher
        if isinstance(publisher, AsyncPublisher):
            self._await(publisher.__aenter__())
        else:
            publisher.__enter__()
        self._entered = True

    def publish(
        self, destination: str, body: bytes, key: str | None, headers: Mapping[str, str]
    ) -> None:
        """Enter the publisher's context if need be, then publish and wait for the broker."""
        self.open()
        # self.is_async, not isinstance: a Protocol's isinstance reads its every member,
        # which cost the relay a third of its round against an in-process broker.
        if self.is_async:
            self._await(self.publisher.publish(destination, body, key, headers))  # type: ignore[arg-type]
        else:
            self.publisher.publish(destination, body, key, headers)

    def publish_window(self, messages: Sequence[Outgoing]) -> Outcomes:
        """Publish a window; one outcome per message (None: confirmed), in order.

        A pipelining publisher sends them all, then waits for the confirms together.
        Any other is driven one publish at a time: after a failure, the later messages of
        that key are NotSent (their order), and after a broker away, every later one is.
        An error the whole window meets is every message's outcome; a ConfigurationError
        (the publisher cannot start) is raised: the relay's fault, never an event's.
        """
        if not messages:
            return []
        if hooks.send is not None:  # telemetry: a PRODUCER span per message around it
            return hooks.send(self.publisher, messages, self._window)
        return self._window(messages)

    def _window(self, messages: Sequence[Outgoing]) -> Outcomes:
        self.open()
        if not self.pipelines:
            return self._one_at_a_time(messages)
        publisher: Any = self.publisher
        window = publisher.publish_window  # async for an AsyncPublisher
        try:
            outcomes: Outcomes = (
                self._await(window(messages)) if self.is_async else window(messages)
            )
        except ConfigurationError:
            raise
        except Exception as exc:
            if broker_away(exc):
                return [exc] * len(messages)
            # One message's error (a header it cannot encode) raised for the whole window:
            # charged to all, it would park every key of the window. One publish at a time
            # charges it to its message alone (those sent already go again: at least once).
            return self._one_at_a_time(messages)
        if not isinstance(outcomes, list | tuple) or len(outcomes) != len(messages):
            given = (
                f"{len(outcomes)} outcomes"
                if isinstance(outcomes, list | tuple)
                else f"a {type(outcomes).__name__}"
            )
            raise ConfigurationError(
                f"{type(publisher).__name__}.publish_window returned {given} for "
                f"{len(messages)} messages: it must return a list of outcomes, one per message"
            )
        return outcomes

    def _one_at_a_time(self, messages: Sequence[Outgoing]) -> Outcomes:
        outcomes: Outcomes = []
        failed_keys: set[str] = set()
        away = False
        # Opened by publish_window: straight to the publisher, no per-message checks.
        publish: Any = (
            (lambda *message: self._await(self.publisher.publish(*message)))  # type: ignore[arg-type]
            if self.is_async
            else self.publisher.publish
        )
        for message in messages:
            # failed_keys holds no None: a message without a key is never held back.
            if away or (failed_keys and message.key in failed_keys):
                outcomes.append(NotSent())
                continue
            try:
                publish(*message)
            except ConfigurationError:
                raise
            except Exception as exc:
                outcomes.append(exc)
                away = broker_away(exc)
                if message.key is not None:
                    failed_keys.add(message.key)
            else:
                outcomes.append(None)
        return outcomes

    def close(self) -> None:
        """Leave the publisher's context, if entered, and close the event loop, if any."""
        entered, self._entered = self._entered, False
        publisher = self.publisher
        try:
            if not entered:
                pass
            elif isinstance(publisher, AsyncPublisher):
                self._await(publisher.__aexit__(None, None, None))
            else:
                publisher.__exit__(None, None, None)
        finally:
            self._loop.close()

    def _await(self, awaitable: Awaitable[T]) -> T:
        self.check_thread()
        return self._loop.run(awaitable)


def broker_away(error: BaseException) -> bool:
    """The broker is away (transient), as opposed to refusing the event: a missing
    destination is the event's, even where the client calls it retriable."""
    return not isinstance(error, DestinationMissing) and classify(error) is ErrorKind.TRANSIENT


class _BlockingOnly(Publisher):
    def __init__(self, publish: Callable[..., Any]) -> None:
        self._publish = publish

    def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._publish(destination, body, key, headers)


class _AsyncOnly(AsyncPublisher):
    def __init__(self, publish: Callable[..., Coroutine[Any, Any, Any]]) -> None:
        self._publish = publish

    async def publish(
        self,
        destination: str,
        body: bytes,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        await self._publish(destination, body, key, headers)


def _adopted(publisher: object) -> Publisher | AsyncPublisher:
    """An object with only ``publish``, as the first Publisher protocol asked: deprecated.

    Its kind is read from ``publish`` once, here: the protocols say it otherwise.
    """
    publish = getattr(publisher, "publish", None)
    if not callable(publish):
        raise ConfigurationError(f"{publisher!r} is no Publisher: it has no publish method")
    warnings.warn(
        f"{type(publisher).__name__} has publish() but is no context manager: subclass "
        "consumerdedup.Publisher (or AsyncPublisher) to get one; this will be refused",
        DeprecationWarning,
        stacklevel=4,
    )
    if inspect.iscoroutinefunction(publish):
        return _AsyncOnly(publish)
    return _BlockingOnly(publish)
