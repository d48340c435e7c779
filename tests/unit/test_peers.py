"""The peer table both the gateway and the scheduler watch: who is alive, and losses, once each."""

from __future__ import annotations

import asyncio
import time

from common.messages import StatsOut
from common.peers import PeerTable

FOREVER = 3600.0


def _beat(peers: PeerTable, instance_id: str, running: int = 0) -> None:
    peers.record(StatsOut(service="scheduler", instance_id=instance_id, time=time.time(),
                          num_running=running))


def _silence(peers: PeerTable, instance_id: str) -> None:
    peers.seen[("scheduler", instance_id)] = time.monotonic() - FOREVER


def _keep_alive(peers: PeerTable, instance_id: str) -> None:
    peers.seen[("scheduler", instance_id)] = time.monotonic() + FOREVER


def test_alive_known_and_load():
    peers = PeerTable(heartbeat_timeout=1.0)
    assert not peers
    _beat(peers, "b", running=3)
    _beat(peers, "a", running=1)
    _silence(peers, "b")
    assert [s.instance_id for s in peers.alive("scheduler")] == ["a"]
    assert sorted(s.instance_id for s in peers.known("scheduler")) == ["a", "b"]
    assert peers.load("scheduler") == {"a": 1}
    assert peers.alive("detokenizer") == []
    peers.on_connection(True)  # back on NATS: silence counts from now
    assert peers.alive_ids("scheduler") == ["a", "b"]


async def test_watcher_reports_each_loss_once_and_again_after_a_return():
    peers = PeerTable(heartbeat_timeout=0.2)
    _beat(peers, "a")
    _beat(peers, "b")
    _keep_alive(peers, "a")
    _keep_alive(peers, "b")
    lost: asyncio.Queue[str] = asyncio.Queue()

    async def on_lost(instance_id: str) -> bool:
        await lost.put(instance_id)
        return True

    connected = [True]
    task = asyncio.create_task(peers.watch("scheduler", on_lost, lambda: connected[0]))
    try:
        _silence(peers, "a")
        assert await asyncio.wait_for(lost.get(), 30) == "a"
        await asyncio.sleep(0.5)  # several rounds while it stays dead
        assert lost.empty()
        _keep_alive(peers, "a")  # it came back ...
        await asyncio.sleep(0.5)
        _silence(peers, "a")  # ... and died again
        assert await asyncio.wait_for(lost.get(), 30) == "a"
        connected[0] = False  # cut off from NATS: silence says nothing about the peers
        _silence(peers, "b")
        await asyncio.sleep(0.5)
        assert lost.empty()
        connected[0] = True
        assert await asyncio.wait_for(lost.get(), 30) == "b"
    finally:
        task.cancel()


async def test_a_peer_that_answers_after_all_is_reported_again():
    """on_lost returning False (late heartbeats, yet alive): the next round asks again."""
    peers = PeerTable(heartbeat_timeout=0.2)
    _beat(peers, "a")
    _silence(peers, "a")
    calls: asyncio.Queue[str] = asyncio.Queue()

    async def on_lost(instance_id: str) -> bool:
        await calls.put(instance_id)
        return False

    task = asyncio.create_task(peers.watch("scheduler", on_lost, lambda: True))
    try:
        assert await asyncio.wait_for(calls.get(), 30) == "a"
        assert await asyncio.wait_for(calls.get(), 30) == "a"
    finally:
        task.cancel()
