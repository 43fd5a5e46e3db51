"""The retention pruner: deletes dedup records no redelivery can need any more."""

from .config import PrunerConfig
from .pruner import Pruner, PruneReport

__all__ = ["PruneReport", "Pruner", "PrunerConfig"]
