"""Who else is out there: the latest heartbeat (`StatsOut`) of every service instance.

The gateway reads it for /health, /metrics and failover, the scheduler to pick a live
detokenizer; both watch it for instances whose heartbeats stopped. The tokenizer's router keeps
views of its own (blocks and load per scheduler, dropped when one falls silent) but judges
silence in the same rounds (`silence_rounds`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from common.logging import get_logger
from common.messages import StatsOut

log = get_logger("peers")

# Called once for each instance whose heartbeats stopped; False: it turned out to be alive.
OnLost = Callable[[str], Awaitable[bool]]


async def silence_rounds(heartbeat_timeout: float,
                         connected: Callable[[], bool]) -> AsyncIterator[None]:
    """Yields every few hundred ms, when silence says something about a peer: never while cut
    off from NATS (we hear nobody: that says nothing about them), nor right after this loop
    itself stalled (heartbeats may be late, not missing)."""
    tick = min(0.25, heartbeat_timeout / 4)
    last = time.monotonic()
    while True:
        await asyncio.sleep(tick)
        now = time.monotonic()
        stalled, last = now - last > tick + heartbeat_timeout / 2, now
        if not stalled and connected():
            yield


class PeerTable:
    def __init__(self, heartbeat_timeout: float) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        self.latest: dict[tuple[str, str], StatsOut] = {}  # (service, id) -> latest heartbeat
        self.seen: dict[tuple[str, str], float] = {}  # (service, id) -> when (monotonic)

    def __bool__(self) -> bool:
        return bool(self.latest)

    def record(self, stats: StatsOut) -> None:
        key = (stats.service, stats.instance_id)
        self.latest[key] = stats
        self.seen[key] = time.monotonic()

    def alive(self, service: str) -> list[StatsOut]:
        """The instances of `service` heard from within the heartbeat timeout."""
        cutoff = time.monotonic() - self.heartbeat_timeout
        return [s for k, s in self.latest.items() if k[0] == service and self.seen[k] >= cutoff]

    def alive_ids(self, service: str) -> list[str]:
        return sorted(s.instance_id for s in self.alive(service))

    def known(self, service: str) -> list[StatsOut]:
        """Every instance of `service` ever heard from, the dead ones' last heartbeat too."""
        return [s for (svc, _), s in self.latest.items() if svc == service]

    def load(self, service: str) -> dict[str, int]:
        """Requests each live instance holds (running and waiting), by id."""
        return {s.instance_id: s.num_running + s.num_waiting for s in self.alive(service)}

    def on_connection(self, up: bool) -> None:
        """Back on NATS: every peer's silence counts from now, not from before the cut."""
        if up:
            now = time.monotonic()
            for key in self.seen:
                self.seen[key] = now

    async def watch(self, service: str, on_lost: OnLost, connected: Callable[[], bool]) -> None:
        """Call `on_lost(id)` once for each instance of `service` whose heartbeats stopped."""
        lost: set[str] = set()
        async for _ in silence_rounds(self.heartbeat_timeout, connected):
            dead = ({s.instance_id for s in self.known(service)}
                    - {s.instance_id for s in self.alive(service)})
            for instance_id in sorted(dead - lost):
                try:
                    if await on_lost(instance_id):
                        lost.add(instance_id)
                except Exception:  # noqa: BLE001 - the watcher must outlive one bad failover
                    log.exception("handling a lost service failed", service=service,
                                  instance_id=instance_id)
            lost &= dead  # one that comes back and dies again is handled again
