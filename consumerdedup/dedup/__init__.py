"""The dedup pipeline: one decision logic (pipeline.py) carried out by a blocking and an
asyncio driver (deduplicator.py, async_deduplicator.py)."""

from .async_deduplicator import AsyncDedupHandler, AsyncDeduplicator
from .deduplicator import DedupHandler, Deduplicator

__all__ = ["AsyncDedupHandler", "AsyncDeduplicator", "DedupHandler", "Deduplicator"]
