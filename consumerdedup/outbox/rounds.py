"""One relay round's publishing: the claimed rows to the broker in per-key order, then
what became of each (published, failed and backed off, or left for the next round)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidMessage
from ..headers import ID_HEADER
from ..reasons import describe
from ..schema import utcnow
from .publisher import NotSent, Outgoing
from .relay_config import RelayConfig
from .sending import Sender, broker_away
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
        """Publish ``rows`` in id order, a window at a time; a failed row holds back its key.

        Within a window the later rows of a failed row's key may already have been sent
        (they were on the wire before its refusal came back): they are neither marked nor
        charged, so the key restarts from the failed row, and consumers dedup the repeats
        by event_id. Rows of a held key in later windows are not sent at all.
        """
        result = RoundResult()
        held_keys: set[str] = set()
        done = result.done
        send = self.sender.publish_window
        position, total, window_size = 0, len(rows), self.config.publish_window
        while position < total and not result.broker_away:
            # Rows and their messages side by side, built in one pass: this loop runs once
            # per event, so it reads each column once and calls nothing it need not.
            sent: list[Any] = []
            messages: list[Outgoing] = []
            room = window_size
            while position < total and room:
                row = rows[position]
                position += 1
                key = row.key
                if key is not None and key in held_keys:
                    continue  # an older row of this key failed in this round: keep the order
                try:
                    # A row written by hand with malformed headers is that row's failure
                    # (and holds its key), never the round's.
                    headers = headers_of(row)
                except InvalidMessage as exc:
                    self._settle(row, exc, result, held_keys)
                    continue
                # Outgoing's own __new__ is Python code; tuple's makes the same Outgoing.
                messages.append(_new(Outgoing, (row.destination, row.body, key, headers)))
                sent.append(row)
                room -= 1
            outcomes = list(send(messages))
            # ``is None`` each: list.count compares with ==, which an error's type may answer.
            if not held_keys and len(outcomes) == len(sent) and all(o is None for o in outcomes):
                done += [row.id for row in sent]  # the common case: all confirmed
                continue
            for row, outcome in zip(sent, outcomes, strict=True):
                if outcome is None and not held_keys:
                    done.append(row.id)
                else:
                    self._settle(row, outcome, result, held_keys)
        return result

    def _settle(
        self, row: Any, outcome: BaseException | None, result: RoundResult, held: set[str]
    ) -> None:
        """File one row's outcome: published, charged, or left for the next round."""
        key = row.key
        if key is not None and key in held:
            return  # an older row of its key failed: sent or not, it goes again after that one
        if outcome is None:
            result.done.append(row.id)
            return
        if key is not None:
            held.add(key)
        if isinstance(outcome, NotSent):
            return
        if broker_away(outcome):
            # The broker is away, not refusing this row: charge no attempt (a long outage
            # must not park healthy events), end the round, back off.
            if not result.broker_away:
                logger.warning("broker unavailable: %s; backing off", describe(outcome))
            result.broker_away = True
            return
        result.failed.append((row, outcome))

    def record(self, conn: Any, result: RoundResult) -> None:
        """Charge the failed rows, mark the published ones (in the caller's transaction)."""
        for row, error in result.failed:
            self._fail(conn, row, error)
        self.statements.mark_published(conn, result.done, utcnow(), self.config.delete_published)

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


_new = tuple.__new__


def headers_of(row: Any) -> dict[str, str]:
    """The row's headers as the publisher takes them; InvalidMessage if the column holds
    anything but a JSON object of strings (Outbox.add writes nothing else)."""
    headers = row.headers  # NOT NULL: None is a JSON null written by hand, refused below
    if type(headers) is dict:  # the column's JSON, decoded afresh for this row: no copy
        for name, value in headers.items():
            if type(name) is not str or type(value) is not str:
                break
        else:
            if headers.get(ID_HEADER) != row.event_id:  # a row written by hand: the column
                headers[ID_HEADER] = row.event_id  # is the id consumers dedup by
            return headers
    if not isinstance(headers, dict) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in headers.items()
    ):
        raise InvalidMessage(
            f"outbox row {row.id}: headers must be a JSON object of strings, got "
            f"{type(headers).__name__}"
            + ("" if not isinstance(headers, dict) else " with other values")
        )
    return {**headers, ID_HEADER: row.event_id}
