"""Which store the test servers' middleware keeps its records in (CDD_HTTP_STORE).

``sql`` (the default): the middleware's engine (no store given). ``redis``: the Redis store
at CDD_HTTP_REDIS_URL (default the local Redis) under CDD_HTTP_REDIS_PREFIX, unique per
server run so that no two runs share a key; transactional routes still use the engine,
since only a SQL store can commit with the business writes.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

REDIS_URL = os.environ.get("CDD_HTTP_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_env() -> dict[str, str]:
    """The environment of a server whose store is Redis, with a prefix of its own."""
    return {"CDD_HTTP_STORE": "redis", "CDD_HTTP_REDIS_PREFIX": f"cdd-http-{uuid.uuid4().hex}:"}


def store_from_env(asynchronous: bool) -> Any:
    """None for the SQL store; else a RedisStore (or AsyncRedisStore for an asyncio app)."""
    if os.environ.get("CDD_HTTP_STORE", "sql") != "redis":
        return None
    from consumerdedup.http.redis_store import AsyncRedisStore, RedisStore

    prefix = os.environ["CDD_HTTP_REDIS_PREFIX"]
    if asynchronous:
        return AsyncRedisStore.from_url(REDIS_URL, prefix)
    return RedisStore.from_url(REDIS_URL, prefix)


def drop_redis_keys(prefix: str) -> None:
    """What a server run left in Redis (each record also expires by itself)."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        for name in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(name)
    finally:
        client.close()
