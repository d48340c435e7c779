"""The bus over a real NATS server: receipts instead of silent drops, and token auth."""

from __future__ import annotations

import asyncio

import nats
import nats.errors
import pytest

from common.bus import Bus
from common.config import ServerArgs
from common.messages import AbortReq, ReceiptOut
from services.launcher.nats import NatsServer


async def _bus(url: str, name: str, **auth) -> Bus:
    bus = Bus(ServerArgs(nats_url=url, **auth), name)
    await bus.connect(attempts=1)
    return bus


def test_nobody_listening_fails_at_once_and_a_listener_signs_the_receipt(nats_server):
    async def main() -> None:
        sender = await _bus(nats_server.url, "gateway:g-1")
        # NoResponders, not the timeout's error: NATS says so at once
        with pytest.raises(nats.errors.NoRespondersError):
            await sender.publish_acked("tl.tokenizer", AbortReq(rid="r"), timeout=5)

        got: list = []
        receiver = await _bus(nats_server.url, "tokenizer:t-7")

        async def handler(msg, headers) -> None:
            got.append(msg)

        await receiver.subscribe("tl.tokenizer", handler, queue="tokenizers")
        for _ in range(20):  # interest reaches the server asynchronously: allow it a moment
            try:
                receipt = await sender.publish_acked("tl.tokenizer", AbortReq(rid="r"),
                                                     timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        assert receipt == ReceiptOut(service="tokenizer", instance_id="t-7")
        await sender.publish("tl.tokenizer", AbortReq(rid="plain"))  # no receipt asked: none
        await sender.flush()
        await asyncio.sleep(0.1)
        assert [m.rid for m in got] == ["r", "plain"]
        await sender.close()
        await receiver.close()

    asyncio.run(main())


def test_token_protected_nats():
    with NatsServer(token="s3cret") as server:
        async def main() -> None:
            bus = await _bus(server.url, "gateway:g", nats_token="s3cret")
            assert bus.connected
            await bus.close()
            with pytest.raises(nats.errors.Error):
                await nats.connect(server.url, token="wrong", allow_reconnect=False)

        asyncio.run(main())


def test_an_unordered_subscription_acknowledges_while_an_earlier_handler_still_waits(nats_server):
    """The tokenizer's case: its handler waits on a scheduler's receipt (seconds when that
    scheduler just died). NATS hands a subscription's messages over one at a time, so in an
    ordered subscription the next request sits unacknowledged behind it and the gateway
    gives up on it; an unordered one acknowledges it at once and handles it alongside."""
    async def main() -> None:
        sender = await _bus(nats_server.url, "gateway:g-1")
        receiver = await _bus(nats_server.url, "tokenizer:t-1")
        release = asyncio.Event()
        got: list[str] = []

        async def handler(msg, headers) -> None:
            if msg.rid.startswith("slow"):
                await release.wait()
            got.append(msg.rid)

        await receiver.subscribe("tl.ordered", handler)
        await receiver.subscribe("tl.unordered", handler, ordered=False)
        await sender.publish_acked("tl.ordered", AbortReq(rid="slow-o"), timeout=2)
        with pytest.raises(nats.errors.TimeoutError):  # behind the waiting handler: no receipt
            await sender.publish_acked("tl.ordered", AbortReq(rid="fast-o"), timeout=0.5)

        await sender.publish_acked("tl.unordered", AbortReq(rid="slow-u"), timeout=2)
        receipt = await sender.publish_acked("tl.unordered", AbortReq(rid="fast-u"), timeout=2)
        assert receipt == ReceiptOut(service="tokenizer", instance_id="t-1")
        for _ in range(100):
            if "fast-u" in got:
                break
            await asyncio.sleep(0.01)
        assert got == ["fast-u"]  # handled while "slow-u" still waits

        # closing drains: the acknowledged, still waiting handler finishes before the bus goes
        closing = asyncio.create_task(receiver.close())
        await asyncio.sleep(0.2)
        assert not closing.done()
        release.set()
        await asyncio.wait_for(closing, timeout=5)
        assert sorted(got) == ["fast-o", "fast-u", "slow-o", "slow-u"]
        await sender.close()

    asyncio.run(main())


def _hand_off_stage(url: str, answer_from: int):
    """A gateway's Failover on a real bus, and a tokenizer on the raw NATS client that takes
    every request but signs a receipt only from its `answer_from`-th on (the ones before:
    lost with the node in between, or the tokenizer died on receiving them)."""
    from common.messages import GenerateReq, SamplingParams, decode, encode
    from common.peers import PeerTable
    from common.subjects import Subjects
    from services.gateway.failover import Failover
    from services.gateway.tracker import Tracker

    async def start():
        subjects = Subjects()
        gateway = await _bus(url, "gateway:g")
        tokenizer = await nats.connect(url)
        took, aborts = [], []

        async def on_request(m) -> None:
            took.append(decode(m.data).rid)
            if len(took) >= answer_from:
                await m.respond(encode(ReceiptOut(service="tokenizer", instance_id="t-2")))

        async def on_abort(m) -> None:
            aborts.append(decode(m.data).rid)

        await tokenizer.subscribe(subjects.tokenizer, queue="tokenizers", cb=on_request)
        await tokenizer.subscribe(subjects.abort, cb=on_abort)
        await tokenizer.flush()
        tracker = Tracker()
        sub = tracker.add(GenerateReq(rid="r", gateway_id="g", text="hi",
                                      params=SamplingParams()), 0, asyncio.Queue())
        failover = Failover(gateway, subjects, PeerTable(5.0), tracker, lambda: None, 0.3)
        return gateway, tokenizer, failover, tracker, sub, took, aborts

    return start()


def test_a_hand_off_without_a_receipt_is_made_again_under_a_fresh_rid(nats_server):
    """No receipt in --heartbeat-timeout: the request may be lost or may run, so it is sent
    again as r~1 and r is aborted (a tokenizer that got it drops it, a scheduler stops it);
    the client gets its answer, not a 503."""
    async def main() -> None:
        gateway, tokenizer, failover, tracker, sub, took, aborts = await _hand_off_stage(
            nats_server.url, answer_from=2)
        await failover.hand_off(sub)
        await asyncio.sleep(0.1)  # the abort's way to the tokenizer
        assert took == ["r", "r~1"] and sub.tokenizer_id == "t-2"
        assert sub.msg.rid == "r~1" and tracker.subs == {"r~1": sub}
        assert aborts == ["r"] and failover.resumed == {"no_receipt": 1}
        await gateway.close()
        await tokenizer.close()

    asyncio.run(main())


def test_a_hand_off_never_signed_for_is_a_503_after_the_resends(nats_server):
    from services.gateway import failover as failover_module
    from services.gateway.protocol import APIError

    async def main() -> None:
        gateway, tokenizer, failover, tracker, sub, took, aborts = await _hand_off_stage(
            nats_server.url, answer_from=10**6)
        with pytest.raises(APIError) as err:
            await failover.hand_off(sub)
        await asyncio.sleep(0.1)
        assert err.value.status == 503 and err.value.code == "tokenizer_unreachable"
        tries = failover_module.HAND_OFF_RESENDS + 1
        assert took == ["r"] + [f"r~{i}" for i in range(1, tries)]
        # each copy but the last aborted here; the last by the caller's _finish (its rid)
        assert aborts == took[:-1] and list(tracker.subs) == [took[-1]]
        await gateway.close()
        await tokenizer.close()

    asyncio.run(main())


def test_free_ports_come_from_below_the_ephemeral_range_and_a_node_listens_on_them():
    """A bind to port 0 hands out ports from the range outgoing connections take their source
    ports from, and one of those took a NATS node's route port between its choice and the
    node's bind ("address already in use": the node exited before listening). free_port picks
    below that range instead, at random, so that parallel test workers do not agree."""
    from services.launcher.nats import FIRST_PORT, ephemeral_ports, free_port

    low, _ = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(FIRST_PORT <= p < low for p in ports) and len(ports) > 10
    with NatsServer(port=free_port(), monitor_port=free_port()) as server:
        assert FIRST_PORT <= server.port < low

        async def main() -> None:
            bus = await _bus(server.url, "gateway:g")
            assert bus.connected
            await bus.close()

        asyncio.run(main())


def test_a_hand_off_whose_response_ended_meanwhile_is_not_sent_again(nats_server):
    """The response closed while it waited for a receipt (a sibling failed, the client left):
    its copy is aborted and nothing is resent, so nothing comes back into the tracker."""
    async def main() -> None:
        gateway, tokenizer, failover, tracker, sub, took, aborts = await _hand_off_stage(
            nats_server.url, answer_from=10**6)
        task = asyncio.ensure_future(failover.hand_off(sub))
        await asyncio.sleep(0.1)
        tracker.subs.pop("r")  # what Tracker.close does for its response
        await asyncio.wait_for(task, timeout=5)
        await asyncio.sleep(0.1)
        assert took == ["r"] and aborts == ["r"] and tracker.subs == {}
        assert sub.tokenizer_id is None and not failover.resumed
        await gateway.close()
        await tokenizer.close()

    asyncio.run(main())
