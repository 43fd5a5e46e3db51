"""Test doubles that are real implementations: use them in your own tests too."""

from .memory_broker import MemoryBroker
from .memory_config import MemoryConfig
from .memory_runner import MemoryConsumerRunner

__all__ = ["MemoryBroker", "MemoryConfig", "MemoryConsumerRunner"]
