"""What every service process shares: start-up, heartbeats, clean shutdown on a signal."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from common import tracing
from common.bus import Bus
from common.config import ServerArgs
from common.logging import get_logger
from common.messages import StatsOut
from common.subjects import Subjects

log = get_logger("service")


class Service:
    """Base of the tokenizer, scheduler and detokenizer services (the gateway too)."""

    name = "service"

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.instance_id = args.resolved_instance_id(self.name)
        self.subjects = Subjects(args.subject_prefix)
        self.bus = Bus(args, f"{self.name}:{self.instance_id}")
        self.started = time.time()
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()  # running ones: cancelled at shutdown

    async def setup(self) -> None:
        """Subscribe to subjects (after the bus is connected)."""

    def stats(self) -> StatsOut:
        return StatsOut(service=self.name, instance_id=self.instance_id, time=time.time(),
                        nats_reconnects=self.bus.reconnects, nats_rtt_s=self.bus.rtt)

    async def _heartbeat(self) -> None:
        subject = self.subjects.stats(self.name, self.instance_id)
        while True:
            try:
                await self.bus.publish(subject, self.stats())
                if self.args.health_file and self.bus.nc is not None and self.bus.nc.is_connected:
                    Path(self.args.health_file).touch()
            except Exception as exc:  # noqa: BLE001 - e.g. while NATS reconnects
                log.debug("heartbeat failed", error=str(exc))
            await asyncio.sleep(self.args.stats_interval)

    async def _measure_rtt(self) -> None:
        """The round trip to our NATS node, for the heartbeat (apart from it: a slow PONG must
        not delay a heartbeat)."""
        while True:
            await self.bus.measure_rtt()
            await asyncio.sleep(self.args.stats_interval)

    def spawn(self, coro: Awaitable) -> asyncio.Task:
        """Run `coro` in the background until it ends or the service shuts down. A finished
        task leaves the set: the tokenizer spawns one per KV snapshot it asks for."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        # nobody awaits these: a failure would otherwise surface only when the task is
        # collected, as asyncio's "exception was never retrieved"
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background task failed", task=task.get_name(),
                      error=repr(exc), exc_info=exc)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stop.set)
        if tracing.setup(self.name, self.args, self.instance_id):
            endpoint, protocol = tracing.resolve_endpoint(self.args) or ("", "")
            log.info("exporting traces over OTLP", endpoint=endpoint, protocol=protocol)
        await self.bus.connect()
        await self.setup()
        self.spawn(self._heartbeat())
        self.spawn(self._measure_rtt())
        log.info(f"{self.name} ready", instance_id=self.instance_id)
        await self._stop.wait()
        # the spans of requests already answered go out first, then whatever the shutdown ends
        # (a bus drain under load can outlast the launcher's 10 s grace: SIGKILL loses the rest)
        await asyncio.get_running_loop().run_in_executor(None, tracing.flush)
        await self.shutdown()
        tracing.shutdown()  # last: spans ended while shutting down still go out

    async def shutdown(self) -> None:
        for task in list(self._tasks):  # a cancelled task leaves the set when it ends
            task.cancel()
        await self.bus.close()

    def stop(self) -> None:
        self._stop.set()


def main(make: Callable[[ServerArgs], Service], name: str, argv: list[str] | None = None) -> None:
    from common.config import parse_server_args
    from common.logging import configure

    args = parse_server_args(argv, prog=f"python -m services.{name}")
    configure(name, args.log_level)
    try:
        service = make(args)
    except (OSError, ValueError) as exc:  # the flags or the model, not a bug: one clear line
        get_logger(name).error("cannot start", error=str(exc))
        sys.exit(1)
    asyncio.run(service.run())
