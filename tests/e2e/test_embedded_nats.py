"""`kill -9` of the nats-server that `tokenline serve` started itself, under load.

The launcher supervises it like its services: it comes back on the same port, every service
reconnects by itself (no service is restarted), the streams that were in flight end at once with
a clear error, and new requests succeed again soon after. (With `--nats-url` the server is not
ours to restart: `test_faults.test_nats_restart_services_reconnect` restarts it by hand.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest
import requests

from tests.e2e.reliability import (
    assert_books_balance,
    cmdline,
    complete,
    nats_pid,
    service_pids,
    tiny_stack,
)

pytestmark = pytest.mark.timeout(300)

IN_FLIGHT = 6
MAX_TOKENS = 400  # long enough to be mid-stream when NATS dies
RECOVERY_S = 30.0  # the promise: serving again within 30 s of the kill
IN_A_ROW = 3


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--heartbeat-timeout", "2", max_model_len=512) as s:
        yield s


def stream_body() -> dict:
    return {"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}


async def kill_nats_under_load(stack) -> tuple[list, float]:
    """IN_FLIGHT streams that have started, then kill -9 of this stack's own nats-server.
    Returns the streams' outcomes and the time of the kill."""
    async with aiohttp.ClientSession() as session:
        started = [asyncio.Event() for _ in range(IN_FLIGHT)]
        streams = [asyncio.create_task(complete(session, stack.url, stream_body(), started=ev,
                                                timeout=60))
                   for ev in started]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in started)), 60)
        os.kill(nats_pid(stack), signal.SIGKILL)
        t_kill = time.monotonic()
        return list(await asyncio.gather(*streams)), t_kill


def serving_again(stack, t_kill: float) -> float:
    """Seconds from the kill to the first success, once IN_A_ROW requests in a row succeeded
    within RECOVERY_S of it."""
    successes: list[float] = []
    while len(successes) < IN_A_ROW:
        assert time.monotonic() - t_kill < RECOVERY_S, (
            f"not serving again {RECOVERY_S}s after the kill:\n{stack.logs()[-3000:]}")
        try:
            r = requests.post(stack.url + "/v1/completions", timeout=RECOVERY_S,
                              json={"prompt": "hello", "max_tokens": 4})
            ok = r.status_code == 200
        except requests.RequestException:
            ok = False
        if ok:
            successes.append(time.monotonic() - t_kill)
        else:
            successes.clear()
            time.sleep(0.25)
    return successes[0]


def test_kill9_embedded_nats_under_load(stack):
    services = service_pids(stack)
    old_nats = nats_pid(stack)
    gateway_nats_url = next(a for a in cmdline(services["gateway"]) if a.startswith("nats:"))

    streams, t_kill = asyncio.run(kill_nats_under_load(stack))
    for out in streams:  # ended, at once and clearly: an SSE error event, then [DONE]
        assert out.status == 200 and out.done, out
        assert out.error is not None and out.error["code"] == "nats_disconnected", out
        assert out.finish is None, out

    took = serving_again(stack, t_kill)
    new_nats = nats_pid(stack)
    print(f"kill -9 of the embedded nats-server: first success {took:.1f}s after the kill")
    assert new_nats != old_nats
    assert f"-p {gateway_nats_url.rsplit(':', 1)[1]}" in " ".join(cmdline(new_nats))
    logs = stack.logs()
    assert "nats-server exited; restarting" in logs, logs[-3000:]
    assert "embedded NATS server restarted" in logs, logs[-3000:]
    assert service_pids(stack) == services  # they reconnected; none was restarted
    assert_books_balance(stack.url, timeout=30)
