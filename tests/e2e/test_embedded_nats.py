"""`kill -9` of the nats-server that `tokenline serve` started itself, under load.

The launcher supervises it like its services: it comes back on the same port, every service
reconnects by itself (no service is restarted), and the streams that were in flight pause, then
finish with the text of an uninterrupted run: what was lost with the server shows at the
gateway as a gap or a stall, and the request resumes after the tokens its client has. New
requests succeed again soon after. (With `--nats-url` the server is not ours to restart:
`test_faults.test_nats_restart_services_reconnect` restarts it by hand; a cluster of three:
tests/integration/test_nats_cluster.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tests import dashboard
from tests.e2e.reliability import (
    assert_books_balance,
    check_identical,
    cmdline,
    complete,
    metrics,
    nats_pid,
    resumed,
    service_pids,
    tiny_stack,
    under_load,
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


def test_a_fresh_serve_serves_every_metric_the_dashboard_queries(stack):
    """Before any request: a panel over a metric with no series yet draws nothing and looks
    broken (`router_decisions_total` had none until a request was routed)."""
    samples = [s for fam in text_string_to_metric_families(metrics(stack.url))
               for s in fam.samples]
    for where, expr in dashboard.expressions(dashboard.load()):
        for name, matchers in dashboard.parse(expr, model_name="tiny").selectors:
            served = [s for s in samples if s.name == name]
            assert served, f"{where}: a fresh `tokenline serve` serves no {name}"
            assert [s for s in served if all(dashboard.matches(m, s.labels)
                                             for m in matchers)], (where, matchers)


def stream_body() -> dict:
    return {"prompt": "The quick brown fox", "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


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


def uninterrupted(url: str) -> str:
    r = requests.post(url + "/v1/completions", timeout=120,
                      json={**stream_body(), "stream": False})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def listens_on(pid: int) -> str:
    """The `listen:` line of a nats-server's config file (its port is no longer on `ps`)."""
    argv = cmdline(pid)
    config = Path(argv[argv.index("-c") + 1]).read_text()
    return next(line for line in config.splitlines() if line.startswith("listen:"))


def test_kill9_embedded_nats_under_load(stack):
    want = uninterrupted(stack.url)
    services = service_pids(stack)
    old_nats = nats_pid(stack)
    gateway_nats_url = next(a for a in cmdline(services["gateway"]) if a.startswith("nats:"))

    streams, t_kill = asyncio.run(kill_nats_under_load(stack))
    for out in streams:  # paused, resumed, finished: nothing lost, nothing twice
        assert out.status == 200 and out.done and out.error is None, out
        assert out.finish == "length" and out.completion_tokens == MAX_TOKENS, out
        assert out.text == want, out
    last = max(o.ended_at for o in streams) - t_kill
    print(f"kill -9 of the embedded nats-server: {len(streams)}/{IN_FLIGHT} streams identical "
          f"to an uninterrupted run, the last ended {last:.1f}s after the kill")

    took = serving_again(stack, t_kill)
    new_nats = nats_pid(stack)
    print(f"kill -9 of the embedded nats-server: first success {took:.1f}s after the kill")
    assert new_nats != old_nats
    assert gateway_nats_url.rsplit(":", 1)[1] in listens_on(new_nats)
    logs = stack.logs()
    assert "nats-server exited; restarting" in logs, logs[-3000:]
    assert "embedded NATS server restarted" in logs, logs[-3000:]
    assert service_pids(stack) == services  # they reconnected; none was restarted
    assert_books_balance(stack.url, timeout=30)


def test_kill9_embedded_nats_with_64_streams_in_flight(stack):
    """What a user without a cluster gets, as tests/integration/test_nats_cluster.py measures
    it for three nodes: the same 64 streams, the same kill."""
    reference = [r.text for r in under_load(stack.url)]
    before = resumed(stack.url)
    runs = under_load(stack.url, lambda: os.kill(nats_pid(stack), signal.SIGKILL))
    check_identical(runs, reference, "kill -9 of the one embedded node")
    print(f"resumed: {resumed(stack.url)} (before the kill: {before})")
    assert_books_balance(stack.url, timeout=30)
