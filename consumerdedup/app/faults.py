"""What an error out of a part's ``run()`` means to the worker: an outage to wait out, a
setup fault to stop on (exit 1 with its fix), or a crash (the child is restarted)."""

from __future__ import annotations

import enum
import sys

import sqlalchemy.exc

from ..errors import BrokerUnavailable, CircuitOpen, ConfigurationError, DestinationMissing
from ..reasons import authentication_refused
from ..retry import ErrorKind, classify, setup_fault


class Fault(enum.Enum):
    OUTAGE = "outage"
    """The database or the broker is away: /readyz says so, the part is run again later."""
    SETUP = "setup"
    """Wrong password, missing table or right, bad option, a consumer stopped by its circuit
    breaker (a broken deploy): restarting cannot fix it."""
    CRASH = "crash"
    """Anything else: the child dies and the supervisor starts another."""


TOPOLOGY_MODULES = ("consumerdedup.adapters.rabbitmq.errors",)
"""Where an adapter's TopologyError lives (the queue is missing, or declared otherwise):
the deploy's to fix, as a missing table is. Read from sys.modules: an error of an adapter
means its module is loaded, and the adapters stay optional imports."""


def _topology_error(error: BaseException) -> bool:
    for name in TOPOLOGY_MODULES:
        module = sys.modules.get(name)
        kind = getattr(module, "TopologyError", None)
        if isinstance(kind, type) and isinstance(error, kind):
            return True
    return False


def fault_of(error: BaseException) -> Fault:
    if isinstance(error, ConfigurationError | DestinationMissing):
        return Fault.SETUP  # AuthenticationFailed included
    if _topology_error(error):
        return Fault.SETUP
    if isinstance(error, CircuitOpen):
        # Not a crash to restart: a new child's breaker starts closed, so each restart would
        # dead-letter breaker_threshold more messages until the whole stream is gone.
        return Fault.SETUP
    if isinstance(error, sqlalchemy.exc.DBAPIError):
        if authentication_refused(error) or setup_fault(error):
            return Fault.SETUP
        if error.statement is None or error.connection_invalidated:
            return Fault.OUTAGE  # no connection to the database at all
    if isinstance(error, BrokerUnavailable | ConnectionError | TimeoutError):
        return Fault.OUTAGE
    if getattr(error, "retriable", False) is True:  # aiokafka's KafkaConnectionError and kin
        return Fault.OUTAGE
    if isinstance(error, Exception) and classify(error) is ErrorKind.TRANSIENT:
        return Fault.OUTAGE
    return Fault.CRASH
