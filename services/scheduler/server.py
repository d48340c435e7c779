"""The scheduler service: the engine core fed from NATS, its steps run in a worker thread.

While the worker computes a step, the event loop keeps receiving requests and aborts (they
queue in the engine's inbox) and publishing the previous step's outputs.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

from common.config import ServerArgs
from common.logging import get_logger
from common.messages import (
    AbortReq,
    AcceptedOut,
    BatchTokenOut,
    ErrorOut,
    FlushCacheOut,
    FlushCacheReq,
    Message,
    StatsOut,
    TokenizedReq,
    TokenOut,
)
from common.service import Service
from common.subjects import SCHEDULER_QUEUE
from services.scheduler.engine import EngineCore

log = get_logger("scheduler")


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.engine = EngineCore(args)
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker")
        self.wake = asyncio.Event()
        self.step_lock = asyncio.Lock()
        self.detokenizers: dict[str, float] = {}  # id -> last heartbeat (monotonic)
        self.route: dict[str, str] = {}  # rid -> detokenizer id, for the request's whole life
        self.headers: dict[str, dict[str, str]] = {}
        self._last_log = 0.0
        self._last_gen = 0

    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.scheduler, self.on_request, queue=SCHEDULER_QUEUE)
        await self.bus.subscribe(self.subjects.scheduler_instance(self.instance_id),
                                 self.on_request)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)
        await self.bus.subscribe(self.subjects.stats_all("detokenizer"), self.on_detok_stats)
        await self.bus.subscribe_requests(self.subjects.flush_cache, self.on_flush)
        self.spawn(self._loop())

    # -- inputs ---------------------------------------------------------------------------------
    async def on_request(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, TokenizedReq):
            return
        queued = len(self.engine.scheduler.waiting) + len(self.engine._inbox)
        if queued >= self.args.max_queued_requests:
            await self.bus.publish(self.subjects.gateway(msg.gateway_id), ErrorOut(
                rid=msg.rid, status=503, err_type="server_overloaded", code="queue_full",
                message=f"the server is busy: {queued} requests are queued "
                        f"(--max-queued-requests {self.args.max_queued_requests}); retry later",
            ))
            return
        self.headers[msg.rid] = headers
        self.engine.submit(msg)
        self.wake.set()
        await self.bus.publish(self.subjects.gateway(msg.gateway_id),
                               AcceptedOut(rid=msg.rid, scheduler_id=self.instance_id))

    async def on_abort(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, AbortReq) and msg.scheduler_id in (None, self.instance_id):
            self.engine.abort(msg)
            self.wake.set()

    async def on_detok_stats(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, StatsOut):
            self.detokenizers[msg.instance_id] = time.monotonic()

    async def on_flush(self, msg: Message) -> Message:
        assert isinstance(msg, FlushCacheReq)
        async with self.step_lock:
            ok, message = self.engine.flush_cache()
        return FlushCacheOut(scheduler_id=self.instance_id, ok=ok, message=message)

    # -- the engine loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    continue
            async with self.step_lock:
                try:
                    outputs = await loop.run_in_executor(self.worker, self.engine.step)
                except Exception:  # noqa: BLE001 - a failed step must not kill the service
                    log.exception("engine step failed")
                    outputs = self._fail_all("internal error in the engine step")
            if outputs:
                await self._publish(outputs)
            self._maybe_log_stats()
            await asyncio.sleep(0)  # let NATS callbacks run between steps

    def _fail_all(self, message: str) -> list[TokenOut]:
        """After an unexpected engine failure, end every request with an error, freeing blocks."""
        from common.messages import Finish

        outs = []
        for req in list(self.engine.requests.values()):
            if not req.is_finished:
                self.engine.scheduler.finish(req, Finish(kind="error", message=message,
                                                         status=500))
            outs.append(self.engine._finish_out(req))
        return outs

    async def _publish(self, outputs: list[TokenOut]) -> None:
        by_detok: dict[str, list[TokenOut]] = defaultdict(list)
        for out in outputs:
            by_detok[self._detokenizer_for(out.rid)].append(out)
            if out.finish is not None:
                self.route.pop(out.rid, None)
                self.headers.pop(out.rid, None)
        for detok_id, items in by_detok.items():
            await self.bus.publish(
                self.subjects.detokenizer(detok_id),
                BatchTokenOut(scheduler_id=self.instance_id, items=items),
            )

    def _detokenizer_for(self, rid: str) -> str:
        alive = self._alive_detokenizers()
        current = self.route.get(rid)
        if current is not None and current in alive:
            return current
        if not alive:
            return current or "none"
        chosen = alive[zlib.crc32(rid.encode()) % len(alive)]
        self.route[rid] = chosen
        return chosen

    def _alive_detokenizers(self) -> list[str]:
        cutoff = time.monotonic() - self.args.heartbeat_timeout
        return sorted(d for d, t in self.detokenizers.items() if t >= cutoff)

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> StatsOut:
        s = StatsOut(service=self.name, instance_id=self.instance_id, time=time.time(),
                     **self.engine.stats())
        s.info = self.engine.server_info()
        return s

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_log < self.args.log_stats_interval:
            return
        st = self.engine.stats()
        elapsed = now - self._last_log if self._last_log else self.args.log_stats_interval
        gen = st["generation_tokens_total"]
        log.info(
            "stats",
            running=st["num_running"],
            queued=st["num_waiting"],
            kv_usage_pct=round(100 * st["kv_usage"], 1),
            gen_tokens_per_s=round((gen - self._last_gen) / elapsed, 1),
            retractions=st["num_retractions_total"],
        )
        self._last_log, self._last_gen = now, gen

    async def shutdown(self) -> None:
        await super().shutdown()
        self.worker.shutdown(wait=False, cancel_futures=True)
