"""One relay round's publishing: the claimed rows to the broker in per-key order, then
what became of each (published, failed and backed off, or left for the next round)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError, DestinationMissing, InvalidMessage
from ..reasons import describe
from ..retry import ErrorKind, classify
from ..schema import utcnow
from .relay_config import RelayConfig
from .sending import Sender
from .statements import RelayStatements

logger = logging.getLogger("consumerdedup.relay")


@dataclass
class RoundResult:
    """What a round's publishing came to, before the marks."""

    done: list[int] = field(default_factory=list)
    """Ids of the rows the broker confirmed, to mark published."""
    failed: list[tuple[Any, BaseException]] = field(default_factory=list)
    """Rows the broker refused (or that cannot be sent), each charged an attempt."""
    broker_away: bool = False
    """The round ended because the broker could not be reached: nothing is charged for it."""


class RoundPublisher:
    """Publishes a round's rows through a Sender and records their outcomes."""

    def __init__(self, sender: Sender, statements: RelayStatements, config: RelayConfig) -> None:
        self.sender = sender
        self.statements = statements
        self.config = config

    def publish(self, rows: list[Any]) -> RoundResult:
        """Publish ``rows`` in order; a failed row holds back its key's later rows."""
        result = RoundResult()
        held_keys: set[str] = set()
        for row in rows:
            if row.key is not None and row.key in held_keys:
                continue  # an older row of this key failed in this round: keep the order
            error = self._publish(row)
            if error is None:
                result.done.append(row.id)
            elif _broker_away(error):
                # The broker is away, not refusing this row: charge no attempt (a long
                # outage must not park healthy events), end the round, back off.
                logger.warning("broker unavailable: %s; backing off", describe(error))
                result.broker_away = True
                break
            else:
                if row.key is not None:
                    held_keys.add(row.key)
                result.failed.append((row, error))
        return result

    def record(self, conn: Any, result: RoundResult) -> None:
        """Charge the failed rows, mark the published ones (in the caller's transaction)."""
        for row, error in result.failed:
            self._fail(conn, row, error)
        self.statements.mark_published(conn, result.done, utcnow(), self.config.delete_published)

    def _publish(self, row: Any) -> BaseException | None:
        try:
            # Inside the handling: a row written by hand with malformed headers is that row's
            # failure (and holds its key), never the round's.
            headers = headers_of(row)
            self.sender.publish(row.destination, row.body, row.key, headers)
        except ConfigurationError:
            raise  # the publisher cannot (re)start: the relay's fault, never the event's
        except Exception as exc:
            return exc
        return None

    def _fail(self, conn: Any, row: Any, error: BaseException) -> None:
        attempts, now, text = row.attempts + 1, utcnow(), describe(error)
        limit = self.config.max_attempts
        self.statements.mark_failed(
            conn,
            row.id,
            now + self.config.backoff(attempts),
            text,
            now=now,
            max_attempts=limit,
            reason=f"{attempts} failed publishes (max_attempts={limit}); last: {text}",
        )
        if attempts >= limit:
            logger.error(
                "outbox event %s parked after %d failed publishes: %s",
                row.event_id,
                attempts,
                text,
            )
        else:
            logger.warning(
                "publishing outbox event %s failed (attempt %d): %s", row.event_id, attempts, text
            )


def _broker_away(error: BaseException) -> bool:
    """The broker is away (transient), as opposed to refusing the event: a missing
    destination is the event's, even where the client calls it retriable."""
    return not isinstance(error, DestinationMissing) and classify(error) is ErrorKind.TRANSIENT


def headers_of(row: Any) -> dict[str, str]:
    """The row's headers as the publisher takes them; InvalidMessage if the column holds
    anything but a JSON object of strings (Outbox.add writes nothing else)."""
    headers = row.headers if row.headers is not None else {}
    if not isinstance(headers, dict) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in headers.items()
    ):
        raise InvalidMessage(
            f"outbox row {row.id}: headers must be a JSON object of strings, got "
            f"{type(headers).__name__}"
            + ("" if not isinstance(headers, dict) else " with other values")
        )
    return dict(headers)
