"""`tokenline serve --nats-cluster 3` under load: kill -9 of a NATS node loses no request.

64 greedy streams in flight; the node the gateway is connected to dies, then the one a
scheduler is on, then two of three one after the other. Every service's client fails over to a
surviving node; output lost with the dead node shows as a gap (or a stall) at the gateway,
which resumes the request after the tokens its client has. Every text equals the uninterrupted
run's, with exactly max_tokens tokens; each request's longest pause between chunks is printed.
The launcher restarts each killed node on its ports, and it rejoins the cluster.
(One embedded node, for comparison: tests/e2e/test_embedded_nats.py.)
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.reliability import (
    _children,
    assert_books_balance,
    check_identical,
    cmdline,
    resumed,
    service_pids,
    tiny_stack,
    under_load,
)
from tests.helpers import metric

pytestmark = [pytest.mark.stack, pytest.mark.timeout(240)]

NODES = 3


@dataclass
class Node:
    pid: int
    port: int  # clients'
    monitor_port: int

    def get(self, path: str) -> dict:
        url = f"http://127.0.0.1:{self.monitor_port}{path}"
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.load(r)


def nodes(stack) -> list[Node]:
    """The launcher's nats-server children, each read from its config file (its ports)."""
    found = []
    for pid in _children(stack.proc.pid):
        argv = cmdline(pid)
        if not argv or os.path.basename(argv[0]) != "nats-server":
            continue
        config = Path(argv[argv.index("-c") + 1]).read_text()
        listen = next(ln for ln in config.splitlines() if ln.startswith("listen:"))
        http = next(ln for ln in config.splitlines() if ln.startswith("http:"))
        found.append(Node(pid, int(listen.strip('"').rsplit(":", 1)[1].strip('"')),
                          int(http.strip('"').rsplit(":", 1)[1].strip('"'))))
    return sorted(found, key=lambda n: n.port)


def node_of(stack, service: str) -> Node:
    """The node the service's NATS client is connected to now (its connection's name)."""
    for node in nodes(stack):
        names = [c.get("name", "") for c in node.get("/connz")["connections"]]
        if any(n.startswith(f"{service}:") for n in names):
            return node
    raise AssertionError(f"no node has a connection of the {service}")


def wait_rejoined(stack, port: int, old_pid: int, timeout: float = 20) -> float:
    """Seconds until the node on `port` runs again (a new process) with routes to the others."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        node = next((n for n in nodes(stack) if n.port == port), None)
        try:
            if node is not None and node.pid != old_pid:
                routes = {r["remote_id"] for r in node.get("/routez")["routes"]}
                if len(routes) == NODES - 1:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the node on {port} did not rejoin in {timeout}s")


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--nats-cluster", str(NODES), "--heartbeat-timeout", "3",
                    max_model_len=256) as s:
        yield s


@pytest.fixture(scope="module")
def reference(stack) -> list[str]:
    runs = under_load(stack.url)
    assert all(r.error is None and r.finish == "length" for r in runs), runs[:2]
    return [r.text for r in runs]


def test_the_cluster_has_three_routed_nodes_and_every_service_all_their_urls(stack):
    found = nodes(stack)
    assert len(found) == NODES
    for node in found:
        assert len({r["remote_id"] for r in node.get("/routez")["routes"]}) == NODES - 1
        assert node.get("/varz")["cluster"]["name"] == "tokenline"
    urls = {f"nats://127.0.0.1:{n.port}" for n in found}
    for pid in service_pids(stack).values():
        argv = cmdline(pid)
        assert set(argv[argv.index("--nats-url") + 1].split(",")) == urls
    # every service measures its round trip to its node (the NATS cost of each hop)
    deadline = time.monotonic() + 10  # the first heartbeats may precede the first PONG
    while True:
        text = urllib.request.urlopen(stack.url + "/metrics", timeout=5).read().decode()
        rtts = {svc: metric(text, "tokenline:nats_rtt_seconds", service=svc)
                for svc in ("gateway", "tokenizer", "scheduler", "detokenizer")}
        if all(rtts.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    assert all(0 < rtt < 1 for rtt in rtts.values()), rtts
    print("NATS round trip by service, ms: "
          + ", ".join(f"{svc} {rtt * 1000:.2f}" for svc, rtt in rtts.items()))


def kill_under_load(stack, reference: list[str], kill, what: str) -> None:
    """64 streams through `kill()`: all identical; how many were resumed, said."""
    before = resumed(stack.url)
    check_identical(under_load(stack.url, kill), reference, what)
    after = resumed(stack.url)
    print("  resumed: " + ", ".join(f"{why} {after[why] - before[why]:.0f}" for why in after))


def test_kill9_of_the_gateways_node_loses_no_request(stack, reference):
    pids = service_pids(stack)
    victim = node_of(stack, "gateway")
    kill_under_load(stack, reference, lambda: os.kill(victim.pid, signal.SIGKILL),
                    "kill -9 of the gateway's node")
    assert node_of(stack, "gateway").port != victim.port or victim.pid not in {
        n.pid for n in nodes(stack)}
    print(f"the killed node rejoined {wait_rejoined(stack, victim.port, victim.pid):.1f}s "
          "after the streams ended")
    assert service_pids(stack) == pids  # reconnected, none restarted
    text = urllib.request.urlopen(stack.url + "/metrics", timeout=5).read().decode()
    assert metric(text, "tokenline:nats_reconnects_total", service="gateway") >= 1


def test_kill9_of_a_schedulers_node_loses_no_request(stack, reference):
    victim = node_of(stack, "scheduler")
    kill_under_load(stack, reference, lambda: os.kill(victim.pid, signal.SIGKILL),
                    "kill -9 of the scheduler's node")
    wait_rejoined(stack, victim.port, victim.pid)


def test_two_of_three_nodes_killed_one_after_the_other_lose_no_request(stack, reference):
    first = node_of(stack, "gateway")
    second = next(n for n in nodes(stack) if n.port != first.port)

    def kill_two() -> None:
        os.kill(first.pid, signal.SIGKILL)
        time.sleep(0.3)
        os.kill(second.pid, signal.SIGKILL)

    kill_under_load(stack, reference, kill_two, "kill -9 of two of three nodes, 0.3 s apart")
    for node in (first, second):
        wait_rejoined(stack, node.port, node.pid)
    assert_books_balance(stack.url, timeout=30)


def test_a_node_that_hangs_then_dies_takes_output_with_it_and_it_is_resumed(stack, reference):
    """The gateway's node stops reading (SIGSTOP) while outputs for the gateway pile up in it,
    then dies: those outputs are gone for good. The gateway sees the gap (or the silence) and
    resumes each request after what its client has; the text is still the uninterrupted one."""
    victim = node_of(stack, "gateway")
    before = resumed(stack.url)

    def hang_then_die() -> None:
        os.kill(victim.pid, signal.SIGSTOP)
        time.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)

    runs = under_load(stack.url, hang_then_die)
    check_identical(runs, reference, "SIGSTOP, then kill -9, of the gateway's node")
    after = resumed(stack.url)
    print(f"resumed: {after} (before: {before})")
    assert after["gap"] + after["stalled"] > before["gap"] + before["stalled"]
    wait_rejoined(stack, victim.port, victim.pid)
