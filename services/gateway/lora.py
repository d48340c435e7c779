"""LoRA adapters as the gateway sees them, and the admin routes that load and unload them.

The schedulers own the adapters. The gateway keeps each scheduler's latest view of its own
(name -> path, stamped with the time of its last change), from its heartbeats and from its
answers to a load or unload, the newest winning: so a gateway learns of a load made through
another one, and a stale heartbeat never brings back an adapter just unloaded. The adapters
served are those any live scheduler serves (--lora-paths before any scheduler has spoken).

A load goes to every scheduler, and each reads and checks the adapter itself; if one refuses
(or does not answer), those that took it drop it again and the route answers with the refusal:
all or nothing. An unload drains (services/scheduler/core/lora_admin.py).
"""

from __future__ import annotations

from common.bus import Bus
from common.messages import LoadLoraReq, LoraOut, Message, StatsOut, UnloadLoraReq
from common.peers import PeerTable
from common.subjects import Subjects
from services.gateway.protocol import APIError, LoadLoraAdapterRequest, UnloadLoraAdapterRequest

TIMEOUT_S = 60.0  # a scheduler reads the adapter between two steps


class AdapterTable:
    def __init__(self, static: dict[str, str], peers: PeerTable) -> None:
        self.static, self.peers = static, peers
        self.views: dict[str, tuple[int, dict[str, str]]] = {}  # scheduler id -> its view

    def record(self, scheduler_id: str, version: int, adapters: dict[str, str]) -> None:
        if version >= self.views.get(scheduler_id, (-1, {}))[0]:
            self.views[scheduler_id] = (version, dict(adapters))

    def on_stats(self, msg: StatsOut) -> None:
        if msg.service == "scheduler" and msg.lora_adapters is not None:
            self.record(msg.instance_id, msg.lora_version, msg.lora_adapters)

    def served(self) -> dict[str, str]:
        """name -> path of every adapter a request may name."""
        live = [self.views[i] for i in self.peers.alive_ids("scheduler") if i in self.views]
        if not live:
            return dict(self.static)
        out: dict[str, str] = {}
        for _, adapters in sorted(live, key=lambda v: v[0]):
            out.update(adapters)
        return out


class AdapterRoutes:
    """/load_lora_adapter and /unload_lora_adapter (admin routes: guards.ADMIN_PATHS)."""

    def __init__(self, bus: Bus, subjects: Subjects, peers: PeerTable, table: AdapterTable,
                 base_name: str) -> None:
        self.bus, self.subjects, self.peers = bus, subjects, peers
        self.table, self.base_name = table, base_name

    async def load(self, req: LoadLoraAdapterRequest) -> dict:
        name = req.lora_name
        if name == self.base_name:
            raise APIError(f"`{name}` is the base model's name", "lora_name")
        if name in self.table.served():
            raise APIError(f"The LoRA adapter `{name}` is already loaded; unload it first",
                           "lora_name")
        expect = self._schedulers()
        replies = await self._ask(self.subjects.load_lora, LoadLoraReq(name, req.lora_path),
                                  expect)
        refused = next((r for r in replies if r.status != 200), None)
        if refused is not None or len(replies) < expect:
            took = [r.scheduler_id for r in replies if r.status == 200]
            if took:  # all or nothing
                await self._ask(self.subjects.unload_lora, UnloadLoraReq(name, only=took),
                                expect)
            if refused is not None:
                raise APIError(refused.message, refused.param, refused.status)
            raise APIError(f"not every scheduler answered in {TIMEOUT_S:.0f} s; the LoRA "
                           f"adapter `{name}` was not loaded", None, 503)
        return {"success": True, "message": f"LoRA adapter `{name}` loaded",
                "loaded_adapters": self.table.served()}

    async def unload(self, req: UnloadLoraAdapterRequest) -> dict:
        name = req.lora_name
        if name not in self.table.served():
            raise APIError(f"The LoRA adapter `{name}` does not exist", "lora_name", 404,
                           code="model_not_found")
        expect = self._schedulers()
        replies = await self._ask(self.subjects.unload_lora, UnloadLoraReq(name), expect)
        refused = next((r for r in replies if r.status not in (200, 404)), None)
        if refused is not None:
            raise APIError(refused.message, refused.param, refused.status)
        if len(replies) < expect:
            raise APIError(f"not every scheduler answered in {TIMEOUT_S:.0f} s; ask again to "
                           f"unload the LoRA adapter `{name}` everywhere", None, 503)
        running = sum(r.running for r in replies)
        message = f"LoRA adapter `{name}` unloaded"
        if running:
            message = (f"LoRA adapter `{name}` unloading: it takes no new request, and is "
                       f"dropped once its {running} running request(s) end")
        return {"success": True, "message": message, "loaded_adapters": self.table.served()}

    def _schedulers(self) -> int:
        n = len(self.peers.alive_ids("scheduler"))
        if not n:
            raise APIError("no scheduler is alive", None, 503)
        return n

    async def _ask(self, subject: str, msg: Message, expect: int) -> list[LoraOut]:
        """Every scheduler's answer (those in time), each one's view recorded."""
        replies = [r for r in await self.bus.gather(subject, msg, expect, TIMEOUT_S)
                   if isinstance(r, LoraOut)]
        for r in replies:
            self.table.record(r.scheduler_id, r.version, r.adapters)
        return [r for r in replies if r.status != 0]  # 0: an undo that did not name it
