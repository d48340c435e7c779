"""Scale-out: two of each service over one NATS server, and a scheduler killed mid-stream.

Requests spread over both schedulers (their queue group), an abort reaches the scheduler that
owns the request, and when a scheduler dies (`kill -9`: its heartbeats stop) the requests it
owned, streaming or still queued, move to the survivor and finish with the same greedy text as
an uninterrupted run. With no scheduler left, streams end at once with a clear error.

The tests share one stack and run in order: the last two kill its schedulers one by one.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import aiohttp
import pytest

from tests.helpers import free_port, wait_healthy
from tests.integration.procs import ServiceProc, StatsWatch

pytestmark = pytest.mark.stack  # starts services as processes (make test-fast skips it)

# Small, to notice a death fast; not smaller: on a loaded 2-core machine a live service's
# heartbeat can be late by more than a second.
HEARTBEAT_TIMEOUT = 3.0
FLAGS = ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--stats-interval", "0.3",
         "--max-total-tokens", "8192"]
# One running request per scheduler: with four streams, some scheduler always has one queued
# when it dies, so both kinds of moved request (streaming and not yet started) are exercised.
SCHEDULER_FLAGS = ["--num-threads", "1", "--max-running-requests", "1"]
SCHEDULERS = ("sched-a", "sched-b")
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU does, in simple words.",
    "Give three tips for learning to cook.",
    "Describe a sunrise over the mountains.",
]
MAX_TOKENS = 56


@dataclass
class Stack:
    procs: dict[str, ServiceProc]
    urls: list[str]
    watch: StatsWatch

    def live_schedulers(self) -> list[str]:
        return [s for s in SCHEDULERS if self.procs[s].alive()]


@pytest.fixture(scope="module")
async def stack(nats_server):
    flags = ["--nats-url", nats_server.url, *FLAGS]
    procs: dict[str, ServiceProc] = {}
    for name in ("detokenizer", "tokenizer"):
        for i in (1, 2):
            procs[f"{name}-{i}"] = ServiceProc.of(
                name, *flags, "--instance-id", f"{name}-{i}", tag=f"scale-{i}").start()
    for sid in SCHEDULERS:
        procs[sid] = ServiceProc.of("scheduler", *flags, *SCHEDULER_FLAGS, "--instance-id", sid,
                                    tag=f"scale-{sid}").start()
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports, 1):
        procs[f"gateway-{i}"] = ServiceProc.of(
            "gateway", *flags, "--port", str(port), "--instance-id", f"gateway-{i}",
            tag=f"scale-{i}").start()
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    watch = await StatsWatch(nats_server.url).start()
    try:
        await watch.wait_for(
            lambda: all(len(watch.of(s)) == 2 for s in
                        ("gateway", "tokenizer", "scheduler", "detokenizer")),
            timeout=240, what="two live instances of every service")
        for url in urls:
            await asyncio.to_thread(wait_healthy, url, 60)
    except Exception:
        for p in procs.values():
            print(f"--- {p.name} ({p.log_path})\n{p.logs()}")
        raise
    yield Stack(procs, urls, watch)
    await watch.close()
    for p in procs.values():
        p.stop()


def _body(content: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


async def chat(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


@dataclass
class Streamed:
    text: str = ""
    chunks: int = 0
    finish: str | None = None
    usage: dict | None = None
    error: dict | None = None
    ended_at: float = 0.0


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict,
                      progress: list[int] | None = None, index: int = 0,
                      stop_after: int | None = None) -> Streamed:
    """One streamed chat completion; `progress[index]` counts its content chunks as they come."""
    out = Streamed()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                out.error = event["error"]
                continue
            out.usage = event.get("usage") or out.usage
            for choice in event["choices"]:
                if content := choice["delta"].get("content"):
                    out.text += content
                    out.chunks += 1
                    if progress is not None:
                        progress[index] = out.chunks
                out.finish = choice.get("finish_reason") or out.finish
            if stop_after is not None and out.chunks >= stop_after:
                break  # leaving the block closes the connection: the client went away
    out.ended_at = time.monotonic()
    return out


def _totals(stack: Stack, field: str) -> dict[str, int]:
    return {sid: getattr(s, field) for sid, s in stack.watch.of("scheduler").items()}


async def test_requests_spread_over_both_schedulers_and_gateways(stack):
    before = _totals(stack, "prompt_tokens_total")
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(
            chat(session, stack.urls[i % 2], _body(f"Count from {i} to {i + 3}.", 2))
            for i in range(12)))
    for status, data in results:
        assert status == 200, data
        assert data["choices"][0]["finish_reason"] in ("length", "stop")
    await stack.watch.wait_for(
        lambda: all(_totals(stack, "prompt_tokens_total")[s] > before.get(s, 0)
                    for s in SCHEDULERS),
        timeout=10, what="prompt tokens counted at both schedulers")


async def test_abort_reaches_the_scheduler_that_owns_the_request(stack):
    watch = stack.watch
    aborted = _totals(stack, "num_aborted_total")
    async with aiohttp.ClientSession() as session:
        body = _body("Tell me a very long story about a dragon.", 400, ignore_eos=True)
        got = await stream_chat(session, stack.urls[1], body, stop_after=3)
    assert got.chunks >= 3 and got.finish is None
    await watch.wait_for(
        lambda: sum(_totals(stack, "num_aborted_total").values()) == sum(aborted.values()) + 1
        and all(s.in_flight == 0 for s in watch.of("scheduler").values()),
        timeout=20, what="the abort applied and every scheduler idle")
    moved_to = [s for s, n in _totals(stack, "num_aborted_total").items() if n > aborted[s]]
    assert len(moved_to) == 1  # one scheduler owned it; the other had nothing to abort


async def test_killed_scheduler_requests_move_and_finish_with_the_same_text(stack):
    watch = stack.watch
    async with aiohttp.ClientSession() as session:
        # the uninterrupted runs, while both schedulers live
        refs = await asyncio.gather(*(chat(session, stack.urls[i % 2], _body(p, MAX_TOKENS))
                                      for i, p in enumerate(PROMPTS)))
        assert all(status == 200 for status, _ in refs), refs
        progress = [0] * len(PROMPTS)
        tasks = [asyncio.create_task(stream_chat(session, stack.urls[i % 2],
                                                 _body(p, MAX_TOKENS), progress, i))
                 for i, p in enumerate(PROMPTS)]

        def victim() -> str | None:
            """A scheduler with one stream about ten chunks in and another request queued."""
            started = [n for n in progress if n]
            if not started or min(started) < 10:
                return None
            busy = [(s.num_waiting, sid) for sid, s in watch.of("scheduler").items()
                    if s.num_running == 1 and s.num_waiting >= 1]
            return max(busy)[1] if busy else None

        await watch.wait_for(lambda: victim() is not None, timeout=120,
                             what="a scheduler streaming with a request queued")
        doomed = victim()
        assert doomed is not None
        stack.procs[doomed].kill()
        killed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

        for (_, ref), got, prompt in zip(refs, results, PROMPTS, strict=True):
            want = ref["choices"][0]
            assert got.error is None, got.error
            assert got.text == want["message"]["content"], prompt
            assert got.finish == want["finish_reason"]
            assert got.usage["completion_tokens"] == ref["usage"]["completion_tokens"]
        assert max(r.ended_at for r in results) > killed_at  # some were still going
        moved = [json.loads(line) for g in ("gateway-1", "gateway-2")
                 for line in stack.procs[g].log_path.read_text().splitlines()
                 if '"request moved"' in line]
        resumed = sorted(m["resumed_after"] for m in moved)
        assert resumed[0] == 0 and resumed[-1] >= 10, moved  # a queued one and a streaming one

        # new requests go to the survivor
        status, data = await chat(session, stack.urls[0], _body("Say hi.", 4))
        assert status == 200, data
    survivor = next(s for s in SCHEDULERS if s != doomed)
    # once idle, every live stage holds nothing for any request
    await watch.wait_for(
        lambda: all(s.in_flight == 0 for (svc, i), s in watch.latest.items()
                    if i != doomed),
        timeout=20, what="every live stage's request table empty")
    assert watch.of("scheduler")[survivor].kv_free_blocks + \
        watch.of("scheduler")[survivor].kv_cached_blocks == \
        watch.of("scheduler")[survivor].kv_total_blocks


async def test_with_no_scheduler_left_streams_fail_fast_with_a_clear_error(stack):
    [last] = stack.live_schedulers()
    progress = [0]
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(stream_chat(
            session, stack.urls[1], _body("Tell me a long story about a cat.", 400,
                                          ignore_eos=True), progress))
        await stack.watch.wait_for(lambda: progress[0] >= 3, timeout=60, what="a stream")
        stack.procs[last].kill()
        # noticed from the heartbeats (scheduler_lost), not ended by the gateway's 120 s
        # inter-output deadline (code "timeout"); the 30 s wait is a liveness bound only
        got = await asyncio.wait_for(task, timeout=30)
        assert got.error is not None and got.error["code"] == "scheduler_lost", got
        assert "no other scheduler is alive" in got.error["message"]
        status, data = await chat(session, stack.urls[0], _body("Say hi.", 4))
        assert status == 503, data
        assert "scheduler" in data["error"]["message"]
