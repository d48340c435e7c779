"""Overload: a burst of five times --max-queued-requests gets fast 503s with Retry-After and
OpenAI's error body; every request the server took completes; memory and books stay bounded."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import requests

from tests.e2e.reliability import (
    assert_books_balance,
    books,
    complete,
    service_pids,
    tiny_stack,
)

pytestmark = pytest.mark.timeout(240)

MAX_QUEUED = 4
MAX_RUNNING = 2
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--max-queued-requests", str(MAX_QUEUED),
                    "--max-running-requests", str(MAX_RUNNING)) as s:
        yield s


async def burst(url: str, n: int) -> list:
    body = {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0}
    async with aiohttp.ClientSession() as session:
        return await asyncio.gather(*(
            complete(session, url, {**body, "stream": bool(i % 2),
                                    "stream_options": {"include_usage": True}})
            for i in range(n)))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def test_burst_gets_fast_503s_and_the_accepted_complete(stack):
    outs = asyncio.run(burst(stack.url, 5 * MAX_QUEUED))
    accepted = [o for o in outs if o.status == 200]
    print(f"{len(accepted)} accepted, {len(outs) - len(accepted)} turned away")
    rejected = [o for o in outs if o.status != 200]
    assert len(accepted) >= MAX_QUEUED, outs
    assert rejected, "nothing was turned away"
    for o in accepted:  # streaming or not, each in full
        assert o.ok and o.finish == "length" and o.completion_tokens == MAX_TOKENS, o
    for o in rejected:
        assert o.status == 503 and o.retry_after is not None and int(o.retry_after) >= 1, o
        assert set(o.error) == {"message", "type", "param", "code"}, o
        assert o.error["code"] == "queue_full" and "--max-queued-requests" in o.error["message"]
    # turned away at once, not after waiting for a slot
    assert max(o.elapsed for o in rejected) < max(o.elapsed for o in accepted), outs
    ok = requests.post(stack.url + "/v1/completions", timeout=60,
                       json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text  # and once the burst is over, all is well


def test_memory_and_state_stay_bounded_over_repeated_bursts(stack):
    pids = service_pids(stack)
    asyncio.run(burst(stack.url, 5 * MAX_QUEUED))
    assert_books_balance(stack.url)
    before = {name: rss_mib(pid) for name, pid in pids.items()}
    for _ in range(3):
        outs = asyncio.run(burst(stack.url, 5 * MAX_QUEUED))
        assert any(o.status == 503 for o in outs) and any(o.ok for o in outs)
    assert_books_balance(stack.url)
    after = {name: rss_mib(pid) for name, pid in pids.items()}
    grown = {name: round(after[name] - before[name], 1) for name in pids}
    assert all(g < 64 for g in grown.values()), (before, after)
    assert service_pids(stack) == pids  # the same processes: nobody died
    b = books(stack.url)
    assert b["gateway"] == 0 and b["scheduler"] == 0, b
