"""Single services as local processes (`python -m services.<name>`), and a NATS stats watcher."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from common import messages
from tests.helpers import REPO


class ServiceProc:
    """One service process; its output goes to a log file that failures print."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], tag: str = "") -> None:
        self.name = name
        self.cmd = cmd
        self.env = env
        self.log_path = Path(tempfile.gettempdir()) / f"tokenline-{name}-{tag or os.getpid()}.log"
        self.proc: subprocess.Popen | None = None

    @classmethod
    def of(cls, name: str, *flags: str, env: dict[str, str] | None = None,
           tag: str = "") -> ServiceProc:
        return cls(name, [sys.executable, "-m", f"services.{name}", *flags],
                   {**os.environ, **(env or {})}, tag)

    def start(self) -> ServiceProc:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9: no clean shutdown, no goodbye on the bus."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def logs(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]


class StatsWatch:
    """The latest heartbeat of every service instance, read off the bus like the gateway does."""

    def __init__(self, nats_url: str, prefix: str = "tl") -> None:
        self.url = nats_url
        self.prefix = prefix
        self.latest: dict[tuple[str, str], messages.StatsOut] = {}
        self.nc = None

    async def start(self) -> StatsWatch:
        import nats

        self.nc = await nats.connect(self.url)

        async def on_msg(raw) -> None:
            msg = messages.decode(raw.data)
            if isinstance(msg, messages.StatsOut):
                self.latest[(msg.service, msg.instance_id)] = msg

        await self.nc.subscribe(f"{self.prefix}.stats.>", cb=on_msg)
        return self

    def of(self, service: str) -> dict[str, messages.StatsOut]:
        return {i: s for (svc, i), s in self.latest.items() if svc == service}

    async def wait_for(self, predicate, timeout: float = 30.0, what: str = "condition") -> None:
        deadline = asyncio.get_running_loop().time() + timeout
        while not predicate():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{what} not reached in {timeout}s: {self.latest}")
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()
