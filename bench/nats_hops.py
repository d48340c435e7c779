"""Each hop's message rate at the limit: one NATS node against a 3-node NATS cluster.

    tokenline bench nats --hops [--messages 20000] [--rounds 3]

A hop is measured with the message it carries in real traffic, encoded as the services encode
it, between two connections of their own (a sender and a receiver, as two services are):

- gateway -> tokenizer: a `GenerateReq` with a 1,200-character prompt, acknowledged
  (request/reply, as `Bus.publish_acked`), 64 in flight;
- tokenizer -> scheduler: a `TokenizedReq` of 300 token ids, acknowledged the same way;
- scheduler -> detokenizer: a `BatchTokenOut` of one 64-request step, published;
- detokenizer -> gateway: a `BatchTextOut` of the same step's text, published.

On one node both ends connect to it. On the cluster the sender connects to node 0 and the
receiver to node 1, so every message crosses a route: the worst case of a cluster, where a
service and the next one on a request's path picked different nodes. Published hops send in
bursts of 256 with a flush after each, as a step's output is, and keep at most 1,024 on their
way: across a route a sender's flush is answered by its own node, so an unpaced sender buries
a slower receiver, whose node cuts it off as a slow consumer at 64 MiB pending (measured:
half of 60,000 step outputs lost that way); a message the receiver never gets counts as lost.
Both ends run in this one Python process, as a service's connection is driven by one event
loop: the rates are what a Python service sustains over each broker setup, far above what a
model's steps produce. The configurations alternate round by round, each on fresh nodes,
measured once the cluster's routes have formed.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import nats

from common import messages
from services.launcher.nats import NatsServer, cluster

WINDOW = 64  # acknowledged messages in flight, as 64 requests arriving at once
BURST = 256  # published messages between flushes
AHEAD = 1024  # published messages sent and not yet received, at most


def _params() -> messages.SamplingParams:
    return messages.SamplingParams(max_new_tokens=128, temperature=0.0)


def hop_messages() -> dict[str, tuple[bytes, bool]]:
    """Each hop's encoded message, and whether it is acknowledged (request/reply)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 27)[:1200]
    step = 64
    gen = messages.GenerateReq(rid="r" * 22, gateway_id="g" * 12, params=_params(), text=prompt,
                               arrival_time=time.time())
    tok = messages.TokenizedReq(rid="r" * 22, gateway_id="g" * 12, params=_params(),
                                input_ids=list(range(1000, 1300)), arrival_time=time.time())
    outs = messages.BatchTokenOut(scheduler_id="s" * 12, items=[
        messages.TokenOut(rid=f"r{i:021d}", gateway_id="g" * 12, token_ids=[4000 + i],
                          offset=40, prompt_tokens=300, completion_tokens=41)
        for i in range(step)])
    texts = messages.BatchTextOut(items=[
        messages.TextOut(rid=f"r{i:021d}", text=" word", token_ids=[4000 + i], offset=40,
                         prompt_tokens=300, completion_tokens=41) for i in range(step)])
    return {"gateway -> tokenizer": (messages.encode(gen), True),
            "tokenizer -> scheduler": (messages.encode(tok), True),
            "scheduler -> detokenizer": (messages.encode(outs), False),
            "detokenizer -> gateway": (messages.encode(texts), False)}


async def _acked_rate(send_url: str, recv_url: str, data: bytes, count: int) -> dict[str, Any]:
    receipt = messages.encode(messages.ReceiptOut(service="bench", instance_id="x"))
    sender, receiver = await nats.connect(send_url), await nats.connect(recv_url)
    try:
        async def on_msg(msg) -> None:
            await msg.respond(receipt)

        await receiver.subscribe("bench.hop", queue="q", cb=on_msg)
        await receiver.flush()
        await sender.flush()  # the subscription has reached the sender's node (routes too)
        await asyncio.sleep(0.2)
        sem = asyncio.Semaphore(WINDOW)
        lost = 0

        async def one() -> None:
            nonlocal lost
            async with sem:
                try:
                    await sender.request("bench.hop", data, timeout=10)
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    lost += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(count)))
        seconds = time.perf_counter() - t0
    finally:
        await sender.close()
        await receiver.close()
    return {"seconds": seconds, "delivered": count - lost, "lost": lost}


async def _published_rate(send_url: str, recv_url: str, data: bytes,
                          count: int) -> dict[str, Any]:
    sender, receiver = await nats.connect(send_url), await nats.connect(recv_url)
    got = 0
    want = 0  # the receiver's count the sender waits for before its next burst
    caught_up = asyncio.Event()
    try:
        async def on_msg(_msg) -> None:
            nonlocal got
            got += 1
            if got >= want:
                caught_up.set()

        await receiver.subscribe("bench.hop", cb=on_msg, pending_msgs_limit=1 << 20,
                                 pending_bytes_limit=1 << 30)
        await receiver.flush()
        await sender.flush()
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        for start in range(0, count, BURST):
            for _ in range(min(BURST, count - start)):
                await sender.publish("bench.hop", data)
            await sender.flush()
            # at most AHEAD messages on their way: a flush only says the sender's node has
            # them, and across a route nothing slows a sender down to its receiver's pace
            sent = min(start + BURST, count)
            want = count if sent == count else sent - AHEAD
            if got < want:
                caught_up.clear()
                try:
                    await asyncio.wait_for(caught_up.wait(), 10)
                except TimeoutError:
                    break  # the rest was lost (a slow consumer cut off): counted below
        seconds = time.perf_counter() - t0
    finally:
        await sender.close()
        await receiver.close()
    return {"seconds": seconds, "delivered": got, "lost": count - got}


def measure_hops(send_url: str, recv_url: str, count: int) -> dict[str, dict[str, Any]]:
    out = {}
    for hop, (data, acked) in hop_messages().items():
        n = count // 4 if acked else count  # a round trip each: fewer of them take as long
        rate: Callable = _acked_rate if acked else _published_rate
        res = asyncio.run(rate(send_url, recv_url, data, n))
        res.update(hop=hop, bytes=len(data), msgs_per_s=res["delivered"] / res["seconds"],
                   mib_per_s=res["delivered"] * len(data) / res["seconds"] / (1 << 20))
        out[hop] = res
    return out


def wait_routed(nodes: list[NatsServer], settle: float = 2.0, timeout: float = 20.0) -> None:
    """Until every node has a route to every other, and then `settle` seconds more: two nodes
    that dialled each other at once close one of the pair about a second after start
    ("Duplicate Route"), and what a sender published meanwhile was lost on the one closed."""
    deadline = time.monotonic() + timeout
    for node in nodes:
        if node.monitor_port is None:
            continue
        while True:
            url = f"http://{node.host}:{node.monitor_port}/routez"
            with urllib.request.urlopen(url, timeout=2) as r:
                remotes = {route["remote_id"] for route in json.load(r)["routes"]}
            if len(remotes) == len(nodes) - 1:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"NATS node {node.url}: routes to {len(remotes)} of "
                                   f"{len(nodes) - 1} others after {timeout}s")
            time.sleep(0.1)
    if len(nodes) > 1:
        time.sleep(settle)


def run(count: int, rounds: int) -> list[dict[str, Any]]:
    """Rows of (config, round, hop, rate), one node and the cluster alternating."""
    rows = []
    configs = ("1 NATS node", "3-node NATS cluster")
    for rnd in range(rounds):
        for label in configs if rnd % 2 == 0 else configs[::-1]:
            nodes = [NatsServer()] if label == configs[0] else cluster(3)
            for node in nodes:
                node.start()
            try:
                wait_routed(nodes)
                recv = nodes[1 % len(nodes)].url
                for hop, res in measure_hops(nodes[0].url, recv, count).items():
                    rows.append({"config": label, "round": rnd, **res})
                    print(f"{label:<20} round {rnd}  {hop:<24} {res['bytes']:>6} B  "
                          f"{res['msgs_per_s']:>9,.0f} msg/s  {res['mib_per_s']:7.1f} MiB/s  "
                          f"lost {res['lost']}", flush=True)
            finally:
                for node in nodes:
                    node.stop()
    return rows


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per hop: the median rate of each configuration and cluster / one node."""
    lines = [f"{'hop':<24} {'bytes':>6} {'1 node msg/s':>13} {'cluster msg/s':>14} "
             f"{'cluster / 1':>11} {'lost':>5}"]
    for hop in dict.fromkeys(r["hop"] for r in rows):
        one = [r for r in rows if r["hop"] == hop and r["config"].startswith("1 ")]
        three = [r for r in rows if r["hop"] == hop and not r["config"].startswith("1 ")]
        a = statistics.median(r["msgs_per_s"] for r in one)
        b = statistics.median(r["msgs_per_s"] for r in three)
        lost = sum(r["lost"] for r in one + three)
        lines.append(f"{hop:<24} {one[0]['bytes']:>6} {a:>13,.0f} {b:>14,.0f} {b / a:>11.3f} "
                     f"{lost:>5}")
    return lines
