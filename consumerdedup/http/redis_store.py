"""The idempotency-key store in Redis (``pip install 'consumerdedup[redis]'``, redis-py).

One Redis string per (scope, key), named ``prefix`` + sha256(scope, key), so neither
the key nor the principal appears in Redis. Its value is a fixed header, the state
(``i`` in flight, ``c`` completed), the claim's token (32 hex) and a digest of the
request's fingerprint (64 hex), then the stored response (StoredResponse.to_bytes).

Redis keeps time: a claim is ``SET ... NX PX lease`` (a worker that dies frees its key
when the lease runs out, with no sweeper), a completed record is set with ``PX expiry``
(Redis drops it then; the same key after that is a new request, as Stripe does). Every
step that reads and then writes is one Lua script, so it is atomic on the server: the
claim (SET NX, else the fingerprint check and the record's state, in one round trip),
renew, complete and release (each only while the caller's token holds the claim).

Not here: the transactional mode. A Redis record cannot commit with the business writes
in SQL; use the SQL store for that.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

try:
    import redis
    import redis.asyncio
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "consumerdedup.http.redis_store needs redis-py: pip install 'consumerdedup[redis]'"
    ) from exc

from ..errors import ConfigurationError
from ..options import instance, refuse, text
from .store import Claimed, ClaimResult, Completed, InFlight, Mismatch
from .stored import CorruptStoredResponse, StoredResponse

DEFAULT_PREFIX = "consumerdedup:idempotency:"
_TOKEN = 32  # uuid4().hex
_HEADER = 1 + _TOKEN + 64  # state, token, fingerprint digest
_UNKNOWN_TTL = 1.0  # Retry-After for an in-flight record Redis reports without a TTL

# KEYS[1] the record; ARGV: the claim's value, the lease (ms), the fingerprint digest.
CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'claimed'} end
local v = redis.call('GET', KEYS[1])
local state = string.sub(v, 1, 1)
if string.len(v) < 97 or (state ~= 'i' and state ~= 'c') then return {'corrupt'} end
if string.sub(v, 34, 97) ~= ARGV[3] then return {'mismatch'} end
if state == 'i' then return {'inflight', redis.call('PTTL', KEYS[1])} end
return {'completed', string.sub(v, 98)}
"""

# The claim still ours: state 'i' and our token (ARGV[1]).
_HELD = """
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 1) ~= 'i' or string.sub(v, 2, 33) ~= ARGV[1] then return 0 end
"""
RENEW = _HELD + "redis.call('PEXPIRE', KEYS[1], ARGV[2])\nreturn 1\n"
COMPLETE = (
    _HELD + "redis.call('SET', KEYS[1], 'c' .. string.sub(v, 2, 97) .. ARGV[3], 'PX', ARGV[2])\n"
    "return 1\n"
)
RELEASE = _HELD + "redis.call('DEL', KEYS[1])\nreturn 1\n"


def _milliseconds(duration: timedelta, name: str) -> int:
    if not isinstance(duration, timedelta) or duration <= timedelta(0):
        raise ConfigurationError(f"the Redis store's {name} must be a timedelta > 0")
    return max(1, int(duration.total_seconds() * 1000))


def _url(url: object, option: str) -> str:
    """A redis:// URL as a str; never quoted back (it may hold a password)."""
    if not isinstance(url, str) or not url.strip():
        raise refuse(option, url, "a Redis URL (a str, redis://host:port/db)", secret=True)
    return url


def _check_client(client: object, kind: type, twin: str) -> None:
    """Fail closed on a client whose replies this store would misread."""
    instance(
        client, f"{twin}.client", kind,
        f"a {kind.__module__}.{kind.__qualname__} client (RedisStore takes redis.Redis, "
        "AsyncRedisStore redis.asyncio.Redis)",
    )  # fmt: skip
    options = client.get_connection_kwargs()  # type: ignore[attr-defined]
    if options.get("decode_responses"):
        raise ConfigurationError(
            f"{twin}: the Redis client decodes responses to str, but stored bodies are bytes; "
            "give it a client made with decode_responses=False (the default)"
        )


class _Records:
    """What the sync and the async store share: key names, script arguments, replies."""

    def __init__(self, prefix: str, twin: str) -> None:
        self.prefix = text(prefix, f"{twin}.prefix")

    def name(self, scope: str, key: str) -> str:
        digest = hashlib.sha256(f"{scope}\x00{key}".encode("utf-8", "surrogateescape"))
        return self.prefix + digest.hexdigest()

    @staticmethod
    def fingerprint(fingerprint: str) -> str:
        # Fixed length whatever the application's fingerprinter returns.
        return hashlib.sha256(fingerprint.encode("utf-8", "surrogateescape")).hexdigest()

    def register(self, client: Any) -> None:
        """The scripts on ``client``, sync or async alike (registering sends nothing: each
        runs by its digest, loaded on first use)."""
        self._claim = client.register_script(CLAIM)
        self._renew = client.register_script(RENEW)
        self._complete = client.register_script(COMPLETE)
        self._release = client.register_script(RELEASE)

    def claim_args(self, fingerprint: str, lease: timedelta) -> tuple[str, list[Any]]:
        token = uuid.uuid4().hex
        digest = self.fingerprint(fingerprint)
        return token, ["i" + token + digest, _milliseconds(lease, "lease"), digest]

    def complete_args(
        self, token: str, expiry: timedelta, response: StoredResponse
    ) -> list[str | int | bytes]:
        return [self.check_token(token), _milliseconds(expiry, "expiry"), response.to_bytes()]

    def claimed(self, token: str, reply: Sequence[Any], name: str) -> ClaimResult:
        state = bytes(reply[0]).decode()
        if state == "claimed":
            return Claimed(token)
        if state == "mismatch":
            return Mismatch()
        if state == "inflight":
            ttl = int(reply[1])
            return InFlight(ttl / 1000 if ttl > 0 else _UNKNOWN_TTL)
        if state == "completed":
            return Completed(StoredResponse.from_bytes(bytes(reply[1])))
        raise CorruptStoredResponse(
            f"the Redis record {name} is not an idempotency record of this store; another "
            "application writes under the prefix: give the store a prefix of its own"
        )

    @staticmethod
    def check_token(token: str) -> str:
        if not isinstance(token, str) or len(token) != _TOKEN:
            raise ConfigurationError("not a claim token of the Redis store")
        return token


class RedisStore(_Records):
    """IdempotencyStore on a blocking ``redis.Redis`` client (thread-safe, as redis-py is)."""

    def __init__(self, client: redis.Redis, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(prefix, "RedisStore")
        _check_client(client, redis.Redis, "RedisStore")
        self.client = client
        self.register(client)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX) -> RedisStore:
        text(prefix, "RedisStore.from_url(prefix)")
        return cls(redis.Redis.from_url(_url(url, "RedisStore.from_url(url)")), prefix)

    def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        name = self.name(scope, key)
        token, args = self.claim_args(fingerprint, lease)
        return self.claimed(token, self._claim(keys=[name], args=args), name)

    def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool:
        args = [self.check_token(token), _milliseconds(lease, "lease")]
        return bool(self._renew(keys=[self.name(scope, key)], args=args))

    def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool:
        args = self.complete_args(token, expiry, response)
        return bool(self._complete(keys=[self.name(scope, key)], args=args))

    def release(self, scope: str, key: str, token: str) -> None:
        self._release(keys=[self.name(scope, key)], args=[self.check_token(token)])


class AsyncRedisStore(_Records):
    """AsyncIdempotencyStore on a ``redis.asyncio.Redis`` client: RedisStore's promises, awaited."""

    def __init__(self, client: redis.asyncio.Redis, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__(prefix, "AsyncRedisStore")
        _check_client(client, redis.asyncio.Redis, "AsyncRedisStore")
        self.client = client
        self.register(client)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX) -> AsyncRedisStore:
        text(prefix, "AsyncRedisStore.from_url(prefix)")
        where = "AsyncRedisStore.from_url(url)"
        return cls(redis.asyncio.Redis.from_url(_url(url, where)), prefix)

    async def claim(self, scope: str, key: str, fingerprint: str, lease: timedelta) -> ClaimResult:
        name = self.name(scope, key)
        token, args = self.claim_args(fingerprint, lease)
        return self.claimed(token, await self._claim(keys=[name], args=args), name)

    async def renew(self, scope: str, key: str, token: str, lease: timedelta) -> bool:
        args = [self.check_token(token), _milliseconds(lease, "lease")]
        return bool(await self._renew(keys=[self.name(scope, key)], args=args))

    async def complete(
        self, scope: str, key: str, token: str, response: StoredResponse, expiry: timedelta
    ) -> bool:
        args = self.complete_args(token, expiry, response)
        return bool(await self._complete(keys=[self.name(scope, key)], args=args))

    async def release(self, scope: str, key: str, token: str) -> None:
        await self._release(keys=[self.name(scope, key)], args=[self.check_token(token)])


__all__ = ["DEFAULT_PREFIX", "AsyncRedisStore", "RedisStore"]
