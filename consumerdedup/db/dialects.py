"""The databases consumerdedup runs on."""

from __future__ import annotations

from ..errors import ConfigurationError

SUPPORTED = ("postgresql", "sqlite")


def require_supported(dialect: str) -> None:
    """ConfigurationError unless ``dialect`` (SQLAlchemy's name for it) is one we run on."""
    if dialect not in SUPPORTED:
        raise ConfigurationError(
            f"unsupported database {dialect!r}: consumerdedup runs on " + " and ".join(SUPPORTED)
        )
