"""What only the Redis store promises, against the real Redis at 127.0.0.1:6379.

The store contract itself (claim, renew, complete, release; sync and async) is the shared
suite's; here: Redis keeps time (the lease and the expiry are Redis TTLs, nothing to
sweep), neither the key nor the principal appears in Redis, each step is atomic on the
server under concurrency, and the guards fail closed on a client or a record this store
would misread.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import redis
import redis.asyncio

from consumerdedup.errors import ConfigurationError
from consumerdedup.http.redis_store import AsyncRedisStore, RedisStore
from consumerdedup.http.store import Claimed, Completed, InFlight, Mismatch
from consumerdedup.http.stored import CorruptStoredResponse, StoredResponse
from tests.support import services

REDIS_URL = "redis://127.0.0.1:6379/0"
SCOPE = "POST /payments @" + "ab" * 16
LEASE = timedelta(seconds=30)
DAY = timedelta(days=1)
RESPONSE = StoredResponse(201, (("content-type", "application/json"),), b'{"id": 1}\n\x00')


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(REDIS_URL)
    try:
        connection.ping()
    except redis.ConnectionError as error:
        services.unavailable(f"no Redis at {REDIS_URL}: {error}")
    yield connection
    connection.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    chosen = f"cdd-test-{uuid.uuid4().hex[:12]}:"
    yield chosen
    for name in client.scan_iter(match=f"{chosen}*"):
        client.delete(name)


@pytest.fixture
def store(client: redis.Redis, prefix: str) -> RedisStore:
    return RedisStore(client, prefix)


def until(condition: object, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_lease_is_a_redis_ttl_a_dead_worker_frees_its_key(store: RedisStore) -> None:
    first = store.claim(SCOPE, "k", "fp", timedelta(milliseconds=200))
    assert isinstance(first, Claimed)
    in_flight = store.claim(SCOPE, "k", "fp", LEASE)
    assert isinstance(in_flight, InFlight) and 0 < in_flight.retry_after <= 0.2
    # Nobody releases: the worker "died". Redis drops the claim when its lease ends.
    until(lambda: isinstance(store.claim(SCOPE, "k", "fp", LEASE), Claimed))
    assert store.complete(SCOPE, "k", first.token, RESPONSE, DAY) is False  # its claim is gone


def test_a_completed_record_expires_in_redis_then_the_key_is_a_new_request(
    store: RedisStore, client: redis.Redis
) -> None:
    claimed = store.claim(SCOPE, "k", "fp", LEASE)
    assert isinstance(claimed, Claimed)
    assert store.complete(SCOPE, "k", claimed.token, RESPONSE, timedelta(milliseconds=300))
    (name,) = list(client.scan_iter(match=f"{store.prefix}*"))
    assert 0 < client.pttl(name) <= 300  # the expiry is Redis's, set with the response
    assert store.claim(SCOPE, "k", "other", LEASE) == Mismatch()
    until(lambda: isinstance(store.claim(SCOPE, "k", "other", LEASE), Claimed))


def test_renew_sets_a_new_ttl_only_for_the_holder(store: RedisStore, client: redis.Redis) -> None:
    claimed = store.claim(SCOPE, "k", "fp", timedelta(seconds=2))
    assert isinstance(claimed, Claimed)
    (name,) = list(client.scan_iter(match=f"{store.prefix}*"))
    assert store.renew(SCOPE, "k", "0" * 32, timedelta(minutes=10)) is False
    assert client.pttl(name) <= 2000
    assert store.renew(SCOPE, "k", claimed.token, timedelta(minutes=10)) is True
    assert client.pttl(name) > 2000


def test_neither_the_key_nor_the_principal_appears_in_redis(
    store: RedisStore, client: redis.Redis
) -> None:
    key = "secret-key-4f1c"
    claimed = store.claim(SCOPE, key, "fp", LEASE)
    assert isinstance(claimed, Claimed)
    store.complete(SCOPE, key, claimed.token, RESPONSE, DAY)
    (name,) = list(client.scan_iter(match=f"{store.prefix}*"))
    assert key.encode() not in name and b"payments" not in name
    assert key.encode() not in client.get(name)  # type: ignore[operator]
    assert store.claim(SCOPE, key, "fp", LEASE) == Completed(RESPONSE)
    assert isinstance(store.claim(SCOPE.replace("ab", "cd"), key, "fp", LEASE), Claimed)


def test_twenty_threads_claim_one_key_exactly_one_wins(store: RedisStore) -> None:
    results: list[object] = []
    barrier = threading.Barrier(20)

    def claim() -> None:
        barrier.wait()
        results.append(store.claim(SCOPE, "k", "fp", LEASE))

    threads = [threading.Thread(target=claim) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sum(isinstance(r, Claimed) for r in results) == 1
    assert sum(isinstance(r, InFlight) for r in results) == 19


def test_the_async_twin_shares_records_with_the_blocking_store(
    store: RedisStore, prefix: str
) -> None:
    async def scenario() -> None:
        connection = redis.asyncio.Redis.from_url(REDIS_URL)
        twin = AsyncRedisStore(connection, prefix)
        try:
            claimed = await twin.claim(SCOPE, "k", "fp", LEASE)
            assert isinstance(claimed, Claimed)
            assert isinstance(store.claim(SCOPE, "k", "fp", LEASE), InFlight)
            assert await twin.renew(SCOPE, "k", claimed.token, LEASE)
            assert await twin.complete(SCOPE, "k", claimed.token, RESPONSE, DAY)
            assert store.claim(SCOPE, "k", "fp", LEASE) == Completed(RESPONSE)
            other = await twin.claim(SCOPE, "j", "fp", LEASE)
            assert isinstance(other, Claimed)
            await twin.release(SCOPE, "j", claimed.token)  # not its token: left alone
            assert isinstance(store.claim(SCOPE, "j", "fp", LEASE), InFlight)
            await twin.release(SCOPE, "j", other.token)
            assert isinstance(store.claim(SCOPE, "j", "fp", LEASE), Claimed)
        finally:
            await connection.aclose()

    asyncio.run(scenario())


def test_a_foreign_value_under_the_prefix_is_refused_not_replayed(
    store: RedisStore, client: redis.Redis
) -> None:
    client.set(store.name(SCOPE, "k"), b"c" + b"x" * 20)  # too short to be ours
    with pytest.raises(CorruptStoredResponse, match="prefix of its own"):
        store.claim(SCOPE, "k", "fp", LEASE)
    client.set(store.name(SCOPE, "j"), b"z" * 200)  # an unknown state
    with pytest.raises(CorruptStoredResponse):
        store.claim(SCOPE, "j", "fp", LEASE)


def test_clients_whose_replies_it_would_misread_are_refused(prefix: str) -> None:
    with pytest.raises(ConfigurationError, match="decode_responses=False"):
        RedisStore(redis.Redis.from_url(REDIS_URL, decode_responses=True), prefix)
    with pytest.raises(ConfigurationError, match=r"redis\.asyncio\.Redis"):
        RedisStore(redis.asyncio.Redis.from_url(REDIS_URL), prefix)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"redis\.Redis"):
        AsyncRedisStore(redis.Redis.from_url(REDIS_URL), prefix)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="prefix"):
        RedisStore(redis.Redis.from_url(REDIS_URL), "")


def test_durations_are_refused_unless_positive(store: RedisStore) -> None:
    with pytest.raises(ConfigurationError, match="lease"):
        store.claim(SCOPE, "k", "fp", timedelta(0))
    claimed = store.claim(SCOPE, "k", "fp", LEASE)
    assert isinstance(claimed, Claimed)
    with pytest.raises(ConfigurationError, match="expiry"):
        store.complete(SCOPE, "k", claimed.token, RESPONSE, timedelta(seconds=-1))


def test_the_contract_on_redis_mismatch_not_stored_and_release(store: RedisStore) -> None:
    claimed = store.claim(SCOPE, "k", "fp", LEASE)
    assert isinstance(claimed, Claimed)
    assert store.claim(SCOPE, "k", "other", LEASE) == Mismatch()  # in flight, another body
    assert store.complete(SCOPE, "k", "f" * 32, RESPONSE, DAY) is False  # not the holder
    assert isinstance(store.claim(SCOPE, "k", "fp", LEASE), InFlight)  # nothing written
    gone = StoredResponse.unreplayable(200)
    assert store.complete(SCOPE, "k", claimed.token, gone, DAY)
    assert store.claim(SCOPE, "k", "fp", LEASE) == Completed(gone)  # remembered as not stored
    assert store.release(SCOPE, "k", claimed.token) is None  # completed: release is a no-op
    assert store.claim(SCOPE, "k", "fp", LEASE) == Completed(gone)
    other = store.claim(SCOPE, "j", "fp", LEASE)
    assert isinstance(other, Claimed)
    store.release(SCOPE, "j", other.token)
    assert isinstance(store.claim(SCOPE, "j", "another", LEASE), Claimed)  # freed for anyone
