"""Holding a group's join at the broker, for the tests of a runner stopped meanwhile: plain
aiokafka members to freeze (a member alive but frozen, SIGSTOPped, holds every JoinGroup
until its session ends), a fixture that says when aiokafka sends a JoinGroup, and a group
left wedged the way Tansu 0.6 leaves one (``wedge``)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from aiokafka.client import AIOKafkaClient, CoordinationType
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata
from aiokafka.protocol.group import JoinGroupRequest, LeaveGroupRequest

from tests.support.kafka_service import KafkaService

COORDINATOR_LOG = "aiokafka.consumer.group_coordinator"

FROZEN_SESSION_MS = 60_000
"""A member's session: the join a frozen member holds would last this long."""

MEMBER = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer

async def main():
    consumer = AIOKafkaConsumer(
        sys.argv[2], bootstrap_servers=sys.argv[1], group_id=sys.argv[3],
        session_timeout_ms=int(sys.argv[4]), heartbeat_interval_ms=1000,
        enable_auto_commit=False,
    )
    await consumer.start()
    while not consumer.assignment():
        await consumer.getmany(timeout_ms=100)
    print("assigned", flush=True)
    while True:
        await consumer.getmany(timeout_ms=100)

asyncio.run(main())
"""

Members = Callable[[KafkaService, str, str], "subprocess.Popen[bytes]"]


@pytest.fixture(name="members")
def members_fixture() -> Iterator[Members]:
    """Starts plain aiokafka group members (subprocesses, FROZEN_SESSION_MS sessions);
    killed at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(kafka: KafkaService, topic: str, group: str) -> subprocess.Popen[bytes]:
        args = [kafka.bootstrap, topic, group, str(FROZEN_SESSION_MS)]
        member = subprocess.Popen([sys.executable, "-c", MEMBER, *args], stdout=subprocess.PIPE)
        started.append(member)
        return member

    yield start
    for member in started:
        member.kill()
        member.wait()


def assigned(member: subprocess.Popen[bytes]) -> None:
    """Returns once ``member`` has its partitions."""
    assert member.stdout is not None
    assert member.stdout.readline().strip() == b"assigned"


def freeze(member: subprocess.Popen[bytes]) -> None:
    """From now on ``member`` holds every join of its group until its session ends."""
    member.send_signal(signal.SIGSTOP)


@pytest.fixture(name="join_sent")
async def join_sent_fixture() -> AsyncIterator[asyncio.Event]:
    """Set once aiokafka logs that it sends a JoinGroup (its DEBUG line, right before).
    The handler goes with the test: aiokafka's logger outlives the test's event loop, and a
    handler left behind broke later tests' group coordination ('Event loop is closed')."""
    sent = asyncio.Event()
    loop = asyncio.get_running_loop()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Sending JoinGroup") and not loop.is_closed():
                loop.call_soon_threadsafe(sent.set)

    coordinator = logging.getLogger(COORDINATOR_LOG)
    seen, level = Seen(logging.DEBUG), coordinator.level
    coordinator.addHandler(seen)
    coordinator.setLevel(logging.DEBUG)
    try:
        yield sent
    finally:
        coordinator.removeHandler(seen)
        coordinator.setLevel(level)


MEMBER_ID_REQUIRED = 79
"""KIP-394: a JoinGroup without a member id is answered with one, to join with."""


async def wedge(kafka: KafkaService, group: str, topic: str) -> None:
    """Leaves ``group`` (of ``topic``) the way Tansu 0.6 keeps a group whose leader left while
    it formed: a member joins, is made its leader, and leaves before any SyncGroup. Tansu's
    LeaveGroup in a forming group removes the member but keeps it as the leader (only a
    leader still among the members is ever replaced), so from then on every member that
    joins is a follower whose SyncGroup is answered REBALANCE_IN_PROGRESS, for ever: none
    is given a partition. Workers stopped while their group forms leave this behind, for
    the next test of the process (one broker each) that joins a group of the same name.
    On Kafka: a member that joins and leaves, nothing more."""
    client = AIOKafkaClient(bootstrap_servers=kafka.bootstrap)
    await client.bootstrap()
    try:
        node = await client.coordinator_lookup(CoordinationType.GROUP, group)
        metadata = ConsumerProtocolMemberMetadata(0, [topic], b"").encode()

        def join(member_id: str) -> JoinGroupRequest:
            protocols = [("roundrobin", metadata)]  # aiokafka's default assignor
            return JoinGroupRequest(group, 60_000, 60_000, member_id, None, "consumer", protocols)

        asked = await client.send(node, join(""))
        assert asked.error_code == MEMBER_ID_REQUIRED, asked
        joined = await client.send(node, join(asked.member_id))
        assert joined.error_code == 0 and joined.leader_id == joined.member_id, joined
        left = await client.send(node, LeaveGroupRequest(group, joined.member_id))
        assert left.error_code == 0, left
    finally:
        await client.close()
