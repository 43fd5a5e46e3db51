"""The front door: ``App`` declares a service's consumers, relay and pruner in one module;
``Settings`` reads ``CONSUMERDEDUP_*`` variables; ``consumerdedup run module:app`` runs it.

Needs the ``app`` extra (pydantic and pydantic-settings): ``pip install 'consumerdedup[app]'``.
"""

try:
    import pydantic  # noqa: F401
    import pydantic_settings  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.app needs pydantic and pydantic-settings: pip install 'consumerdedup[app]'"
    ) from exc

from ..lifecycle import RunningPart
from .app import App
from .parts import Part
from .settings import Settings
from .typed_bodies import InvalidBody

__all__ = ["App", "InvalidBody", "Part", "RunningPart", "Settings"]
