"""Faults under load: `kill -9` of a tokenizer, detokenizer or scheduler, and a NATS restart.

Every request in flight ends in time (in full, or with a clear 503/504, an SSE error event when
streaming), never hangs; the launcher restarts the dead service (as `python -m services.<name>`);
new requests succeed again within 30 s; and afterwards the books balance.

One stack for the module, on a NATS server this test owns (so it can restart it).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
import requests

from services.launcher.nats import NatsServer
from tests.e2e.reliability import (
    SERVICES,
    Outcome,
    assert_books_balance,
    assert_ended_cleanly,
    cmdline,
    complete,
    kill9,
    service_pids,
    tiny_stack,
    wait_restarted,
)
from tests.helpers import wait_healthy

pytestmark = pytest.mark.timeout(300)

HEARTBEAT_TIMEOUT = 2.0
FIRST_OUTPUT_TIMEOUT = 20.0
INTER_OUTPUT_TIMEOUT = 10.0
# the longest any request may take to end after a fault: the deadlines, plus slack for a
# machine busy with other tests
DEADLINE = FIRST_OUTPUT_TIMEOUT + INTER_OUTPUT_TIMEOUT + 10
RECOVERY_S = 30.0
MAX_TOKENS = 400  # long enough to be mid-stream when the fault hits
IN_FLIGHT = 6


@pytest.fixture(scope="module")
def nats():
    server = NatsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, nats):
    with tiny_stack(tiny_model_dir, "--nats-url", nats.url,
                    "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                    "--first-output-timeout", str(FIRST_OUTPUT_TIMEOUT),
                    "--inter-output-timeout", str(INTER_OUTPUT_TIMEOUT),
                    max_model_len=512) as s:
        yield s


def body(stream: bool = True, max_tokens: int = MAX_TOKENS) -> dict:
    return {"prompt": "The quick brown fox", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}}


async def under_load(url: str, fault, trickle_s: float = 3.0) -> tuple[list, list]:
    """IN_FLIGHT streams that have started, then `fault()`, while new requests keep arriving
    for `trickle_s` seconds. Returns (the streams' outcomes, the newcomers' outcomes)."""
    async with aiohttp.ClientSession() as session:
        started = [asyncio.Event() for _ in range(IN_FLIGHT)]
        streams = [asyncio.create_task(complete(session, url, body(), started=ev,
                                                timeout=DEADLINE + 20))
                   for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        fault()
        newcomers = []
        t_end = time.monotonic() + trickle_s
        i = 0
        while time.monotonic() < t_end:
            newcomers.append(asyncio.create_task(complete(
                session, url, body(stream=bool(i % 2), max_tokens=8), timeout=DEADLINE + 20)))
            i += 1
            await asyncio.sleep(0.1)
        outs = list(await asyncio.gather(*streams))
        for out in outs:
            if out.error is not None:  # noticed the loss itself, not a deadline for it
                assert out.error.get("code") != "timeout", out
        return outs, list(await asyncio.gather(*newcomers))


def _tally(outs: list[Outcome]) -> dict[str, int]:
    codes = [(o.error["code"] or o.error["message"][:40]) if o.error else "ok" for o in outs]
    return {c: codes.count(c) for c in sorted(set(codes))}


def check_outcomes(streams: list[Outcome], newcomers: list[Outcome]) -> tuple[dict, dict]:
    """Each ended cleanly; what the streams in flight and the newcomers saw, by error code."""
    for out in streams:
        assert_ended_cleanly(out, MAX_TOKENS)
    for out in newcomers:
        assert_ended_cleanly(out, 8)
    return _tally(streams), _tally(newcomers)


def recovers(stack, within: float = RECOVERY_S) -> float:
    """Seconds until a new request succeeds again."""
    t0 = time.monotonic()
    while True:
        try:
            r = requests.post(stack.url + "/v1/completions", timeout=DEADLINE,
                              json={"prompt": "hello", "max_tokens": 4})
            if r.status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        assert time.monotonic() - t0 < within, f"no success within {within}s"
        time.sleep(0.25)


def kill_and_check(stack, name: str) -> tuple[dict, dict]:
    old = service_pids(stack)[name]
    streams, newcomers = asyncio.run(under_load(stack.url, lambda: kill9(stack, name)))
    seen = check_outcomes(streams, newcomers)
    new = wait_restarted(stack, name, old)
    assert f"services.{name}" in cmdline(new)
    took = recovers(stack)
    assert_books_balance(stack.url, timeout=30)
    print(f"kill -9 {name}: streams {seen[0]}, newcomers {seen[1]}; "
          f"serving again after {took:.1f}s")
    return seen


def test_kill_tokenizer_under_load(stack):
    streams, newcomers = kill_and_check(stack, "tokenizer")
    # the streams were past the tokenizer: they finish; newcomers get a 503 at worst, at once
    assert streams == {"ok": IN_FLIGHT}, streams
    assert set(newcomers) <= {"ok", "no_tokenizer", "tokenizer_lost",
                              "tokenizer_unreachable"}, newcomers


def test_kill_detokenizer_under_load(stack):
    streams, newcomers = kill_and_check(stack, "detokenizer")
    # its decoding state died with it: each stream fails fast with a 503 event, found by the
    # heartbeats stopping, not by the deadline
    assert streams == {"detokenizer_lost": IN_FLIGHT}, streams
    assert set(newcomers) <= {"ok", "detokenizer_lost", "no_detokenizer"}, newcomers


def test_kill_scheduler_under_load(stack):
    streams, newcomers = kill_and_check(stack, "scheduler")
    # moved to the restarted scheduler (issue 9) or failed at once with a 503 naming the loss
    assert set(streams) <= {"ok", "scheduler_lost"}, streams
    assert set(newcomers) <= {"ok", "scheduler_lost", "no_scheduler",
                              "scheduler_unreachable"}, newcomers


def test_nats_restart_services_reconnect(stack, nats):
    pids = service_pids(stack)

    def restart_nats() -> None:
        nats.stop()
        time.sleep(1.0)
        nats.start()  # the same port: every service reconnects by itself

    streams, newcomers = asyncio.run(under_load(stack.url, restart_nats))
    seen = check_outcomes(streams, newcomers)
    wait_healthy(stack.url, RECOVERY_S)
    took = recovers(stack)
    assert service_pids(stack) == pids  # reconnected, not restarted
    assert_books_balance(stack.url, timeout=30)
    print(f"NATS restart: streams {seen[0]}, newcomers {seen[1]}; "
          f"serving again after {took:.1f}s")
    # back within --heartbeat-timeout: whatever was streaming paused, then finished in full
    # (output lost in the gap is resumed after the tokens the client has, never skipped)
    assert seen[0] == {"ok": IN_FLIGHT}, seen


def test_every_service_is_still_there(stack):
    assert set(service_pids(stack)) == set(SERVICES)
