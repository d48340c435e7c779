"""The scheduler service: the engine core fed from NATS, its steps run in a worker thread.

While the worker computes a step, the event loop keeps receiving requests and aborts (they
queue in the engine's inbox) and publishing the previous step's outputs.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from common import malloc, tracing
from common.config import ServerArgs
from common.logging import get_logger, request_logger
from common.messages import (
    AbortReq,
    AcceptedOut,
    BatchTokenOut,
    ErrorOut,
    FlushCacheOut,
    FlushCacheReq,
    KvEventsOut,
    KvSnapshotOut,
    KvSnapshotReq,
    LoadLoraReq,
    LoraOut,
    Message,
    StatsOut,
    TokenizedReq,
    TokenOut,
    UnloadLoraReq,
)
from common.peers import PeerTable
from common.service import Service
from common.subjects import SCHEDULER_QUEUE
from services.scheduler import process_setup
from services.scheduler.core.engine import EngineCore, StepStats
from services.scheduler.spans import SchedulerSpans

log = get_logger("scheduler")


@dataclass
class Route:
    """Where a request's messages go, from its arrival until its end is published."""

    gateway_id: str
    headers: dict[str, str]  # its trace context, for log lines
    detokenizer_id: str | None = None  # chosen at its first output, kept for its whole life
    failed: bool = False  # the gateway was told it failed; its abort is under way


class SchedulerService(Service):
    name = "scheduler"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        running = malloc.running()  # what runs, not what was asked for
        process_setup.check(args, running, os.environ, os.sched_getaffinity(0))
        log.info(f"malloc: {running[0]}", library=running[1], asked=args.malloc)
        if places := os.environ.get("OMP_PLACES"):
            log.info("OpenMP threads bound one per core", places=places,
                     threads=os.environ.get("OMP_NUM_THREADS"))
        # Every torch call runs on this one thread, the model's loading included: libgomp keeps
        # a thread team per calling thread, and once two teams outnumber the cores it stops
        # spinning between parallel regions. A decode step at batch 1 then took 25 ms, not 19.
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model-worker")
        self.engine = self.worker.submit(EngineCore, args).result()
        self.engine.enable_kv_events()
        self.kv_seq = 0  # the last KvEventsOut sent
        self.wake = asyncio.Event()
        self.step_lock = asyncio.Lock()
        self.peers = PeerTable(args.heartbeat_timeout)  # the detokenizers' heartbeats
        self.routes: dict[str, Route] = {}  # rid -> its route, while the request lives here
        # (time, rid, gateway id, detokenizer id) of requests that ended lately: their last
        # output may have gone to a detokenizer that died before passing it on
        self.ended: deque[tuple[float, str, str, str]] = deque()
        self.detokenizer_seen = asyncio.Event()
        self.spans: SchedulerSpans | None = None  # set up only when tracing is on
        self._seen_step: StepStats | None = None
        self._stats_since: float | None = None  # start of the stats line's window (busy)
        self._last_gen = 0
        self._last_drafted = self._last_accepted = 0  # speculation: the stats window's start
        self._last_prompt = 0

    async def setup(self) -> None:
        # Outputs need a detokenizer to go to: take no request before one is known.
        await self.bus.subscribe(self.subjects.stats_all("detokenizer"), self.on_detok_stats)
        if not self.detokenizer_seen.is_set():
            log.info("waiting for a detokenizer's heartbeat")
            await self.detokenizer_seen.wait()
        await self.bus.subscribe(self.subjects.scheduler, self.on_request, queue=SCHEDULER_QUEUE)
        await self.bus.subscribe(self.subjects.scheduler_instance(self.instance_id),
                                 self.on_request)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)
        self.spawn(self.peers.watch("detokenizer", self._detokenizer_gone,
                                    lambda: self.bus.connected))
        self.bus.on_connection_change.append(self.peers.on_connection)
        await self.bus.subscribe_requests(self.subjects.flush_cache, self.on_flush)
        await self.bus.subscribe_requests(self.subjects.load_lora, self.on_lora)
        await self.bus.subscribe_requests(self.subjects.unload_lora, self.on_lora)
        await self.bus.subscribe_requests(self.subjects.kv_snapshot(self.instance_id),
                                          self.on_kv_snapshot)
        await self._publish_kv_events()  # "empty": routers that knew an earlier life forget it
        if tracing.enabled():
            self.spans = SchedulerSpans()
        self.spawn(self._loop())

    # -- inputs ---------------------------------------------------------------------------------
    async def on_request(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, TokenizedReq):
            return
        queued = self.engine.num_queued()
        if queued >= self.args.max_queued_requests:
            await self.bus.publish(self.subjects.gateway(msg.gateway_id), ErrorOut(
                rid=msg.rid, status=503, err_type="server_overloaded", code="queue_full",
                message=f"the server is busy: {queued} requests are queued "
                        f"(--max-queued-requests {self.args.max_queued_requests}); retry later",
            ))
            return
        self.routes[msg.rid] = Route(msg.gateway_id, headers)
        if self.spans is not None:
            self.spans.arrive(msg, headers)
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
            self.peers.record(msg)
            self.detokenizer_seen.set()

    async def on_flush(self, msg: Message) -> Message:
        assert isinstance(msg, FlushCacheReq)
        async with self.step_lock:
            ok, message = await asyncio.get_running_loop().run_in_executor(
                self.worker, self.engine.flush_cache)
            await self._publish_kv_events()
        return FlushCacheOut(scheduler_id=self.instance_id, ok=ok, message=message)

    async def on_lora(self, msg: Message) -> Message:
        """/load_lora_adapter and /unload_lora_adapter: between two steps, on the model's
        thread (reading an adapter takes that thread's time, not the event loop's)."""
        assert isinstance(msg, LoadLoraReq | UnloadLoraReq)
        if isinstance(msg, UnloadLoraReq) and msg.only is not None \
                and self.instance_id not in msg.only:
            return LoraOut(scheduler_id=self.instance_id, status=0)
        if isinstance(msg, LoadLoraReq):
            work = lambda: self.engine.load_lora(msg.lora_name, msg.lora_path)  # noqa: E731
        else:
            work = lambda: self.engine.unload_lora(msg.lora_name)  # noqa: E731
        async with self.step_lock:
            reply = await asyncio.get_running_loop().run_in_executor(self.worker, work)
        log.info("LoRA adapter " + ("load" if isinstance(msg, LoadLoraReq) else "unload"),
                 lora_name=msg.lora_name, status=reply.status, message=reply.message)
        loras = self.engine.loras
        return LoraOut(scheduler_id=self.instance_id, status=reply.status,
                       message=reply.message, param=reply.param, running=reply.running,
                       adapters=loras.adapters,
                       version=loras.version)

    # -- KV events ------------------------------------------------------------------------------
    async def _publish_kv_events(self) -> None:
        """Send what entered and left the prefix cache since the last batch (no step running:
        the caller holds `step_lock`, or is the loop between steps)."""
        events = self.engine.take_kv_events()
        if not events:
            return
        self.kv_seq += 1
        batch = KvEventsOut(scheduler_id=self.instance_id, seq=self.kv_seq,
                            block_size=self.args.page_size, events=events)
        try:
            await self.bus.publish(self.subjects.kv_events(self.instance_id), batch)
        except Exception as exc:  # noqa: BLE001 - consumers see the gap and ask for a snapshot
            log.warning("KV events not sent", seq=self.kv_seq, error=str(exc))

    async def on_kv_snapshot(self, msg: Message) -> Message:
        assert isinstance(msg, KvSnapshotReq)
        async with self.step_lock:  # no step changes the cache while it is read
            await self._publish_kv_events()  # so that `seq` covers everything in the snapshot
            return KvSnapshotOut(scheduler_id=self.instance_id, seq=self.kv_seq,
                                 block_size=self.args.page_size,
                                 block_hashes=self.engine.cached_block_hashes())

    # -- the engine loop ------------------------------------------------------------------------
    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                self._log_stats_line(idle=True)
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    continue
            async with self.step_lock:
                t0 = time.time_ns()
                try:
                    outputs = await loop.run_in_executor(self.worker, self.engine.step)
                except Exception:  # noqa: BLE001 - a failed step must not kill the service
                    log.exception("engine step failed")
                    outputs = self.engine.fail_all("internal error in the engine step")
                t1 = time.time_ns()
                await self._publish_kv_events()
            if self.engine.last_step is not self._seen_step:
                self._seen_step = self.engine.last_step
                self._log_retractions(self._seen_step)
            if outputs:
                try:
                    await self._publish(outputs)
                except Exception:  # noqa: BLE001 - e.g. NATS's buffer full while cut off
                    log.exception("publishing a step's outputs failed")
            if self.spans is not None:  # after publishing: the detokenizer got their contexts
                self.spans.after_step(outputs, self.engine.last_step, t0, t1)
            self._maybe_log_stats()
            await asyncio.sleep(0)  # let NATS callbacks run between steps

    async def _publish(self, outputs: list[TokenOut]) -> None:
        by_detok: dict[str, list[TokenOut]] = defaultdict(list)
        now = time.monotonic()
        for out in outputs:
            detok_id = self._detokenizer_for(out.rid)
            if detok_id is None:
                await self._fail(out.rid, out.gateway_id, out.finish is None,
                                 "no detokenizer is alive to decode this request", "no_detokenizer")
            elif not self._failed(out.rid):
                by_detok[detok_id].append(out)
            if out.finish is not None:
                if detok_id is not None:
                    self.ended.append((now, out.rid, out.gateway_id, detok_id))
                route = self.routes.pop(out.rid, None)
                if out.finish.kind in ("abort", "error"):
                    self._log_end(out, route.headers if route is not None else None)
        self._forget_old_ends()
        for detok_id, items in by_detok.items():
            await self.bus.publish(
                self.subjects.detokenizer(detok_id),
                BatchTokenOut(scheduler_id=self.instance_id, items=items),
                self._item_contexts(items) if self.spans is not None else None,
            )

    def _item_contexts(self, items: list[TokenOut]) -> dict[str, str] | None:
        """Each new request's trace context, for the detokenizer's span (first items only)."""
        assert self.spans is not None
        headers = {}
        for i, item in enumerate(items):
            if item.first and (tp := self.spans.traceparent(item.rid)) is not None:
                headers[tracing.item_header(i)] = tp
        return headers or None

    def _detokenizer_for(self, rid: str) -> str | None:
        route = self.routes.get(rid)
        if route is not None and route.detokenizer_id is not None:
            return route.detokenizer_id  # until it is declared lost (`_on_detokenizer_lost`)
        alive = self.peers.alive_ids("detokenizer")
        if not alive:
            return None
        chosen = alive[zlib.crc32(rid.encode()) % len(alive)]
        if route is not None:
            route.detokenizer_id = chosen
        return chosen

    def _failed(self, rid: str) -> bool:
        route = self.routes.get(rid)
        return route is not None and route.failed

    # -- detokenizer loss -----------------------------------------------------------------------
    def _forget_old_ends(self) -> None:
        """Past twice the heartbeat timeout, a detokenizer that took an end has passed it on."""
        cutoff = time.monotonic() - 2 * self.args.heartbeat_timeout
        while self.ended and self.ended[0][0] < cutoff:
            self.ended.popleft()

    async def _detokenizer_gone(self, detok_id: str) -> bool:
        await self._on_detokenizer_lost(detok_id)
        return True

    async def _on_detokenizer_lost(self, detok_id: str) -> None:
        """Fail at once every request whose text a dead detokenizer was making.

        Its decoding state and whatever output it had not passed on are gone: a new detokenizer
        could not continue the text without a gap, so the request ends with a 503 (freeing its
        blocks), and so does one whose last output may have died with it."""
        self._forget_old_ends()
        running = [(rid, r) for rid, r in self.routes.items() if r.detokenizer_id == detok_id]
        ended = [(rid, gw) for _, rid, gw, d in self.ended if d == detok_id]
        if running or ended:
            log.warning("detokenizer lost", detokenizer_id=detok_id, requests=len(running))
        message = f"the detokenizer decoding this request ({detok_id}) stopped responding"
        for rid, route in running:
            route.detokenizer_id = None
            await self._fail(rid, route.gateway_id, True, message, "detokenizer_lost")
        for rid, gateway_id in ended:  # a gateway that did get the end ignores this
            await self._fail(rid, gateway_id, False, message, "detokenizer_lost")

    async def _fail(self, rid: str, gateway_id: str, abort: bool, message: str,
                    code: str) -> None:
        """Tell the gateway directly (no detokenizer in between) and stop the request."""
        if self._failed(rid):
            return
        if abort:
            if (route := self.routes.get(rid)) is not None:
                route.failed = True
            self.engine.abort(AbortReq(rid=rid, reason=message))
            self.wake.set()
        await self.bus.publish(self.subjects.gateway(gateway_id), ErrorOut(
            rid=rid, message=message + "; retry", status=503, err_type="service_unavailable",
            code=code))

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> StatsOut:
        s = StatsOut(service=self.name, instance_id=self.instance_id, time=time.time(),
                     nats_reconnects=self.bus.reconnects, nats_rtt_s=self.bus.rtt,
                     kv_events_seq=self.kv_seq,
                     **self.engine.stats())
        # a request has a route from its arrival until its end is published, so the routes
        # cover the engine's table too: both are empty when the larger one is
        s.in_flight = max(s.in_flight, len(self.routes))
        s.info = self.engine.server_info()
        return s

    def _maybe_log_stats(self) -> None:
        """A stats line every --log-stats-interval seconds while busy."""
        now = time.monotonic()
        if self._stats_since is None:  # the first step after idle opens a new window
            self._stats_since = now
        else:
            self._log_stats_line(idle=False)

    def _log_stats_line(self, idle: bool) -> None:
        """Log the window that ends now, once it spans the interval; idle, the line closes the
        window (if it did any work), and the next starts with the next step."""
        if self._stats_since is None:
            return
        now = time.monotonic()
        elapsed = now - self._stats_since
        if elapsed < self.args.log_stats_interval:
            return  # a short pause between requests does not cut the window
        st = self.engine.stats()
        gen, prompt = st["generation_tokens_total"], st["prompt_tokens_total"]
        if not idle or gen != self._last_gen or prompt != self._last_prompt:
            log.info(
                "stats",
                running=st["num_running"],
                queued=st["num_waiting"],
                kv_usage_pct=round(100 * st["kv_usage"], 1),
                prompt_tokens_per_s=round((prompt - self._last_prompt) / elapsed, 1),
                gen_tokens_per_s=round((gen - self._last_gen) / elapsed, 1),
                retractions=st["num_retractions_total"],
                **self._acceptance(st),
            )
        self._last_gen, self._last_prompt = gen, prompt
        self._stats_since = None if idle else now

    def _acceptance(self, st: dict) -> dict:
        """The draft acceptance rate over the window, where speculation is on."""
        if "spec_num_draft_tokens_total" not in st:
            return {}
        drafted = st["spec_num_draft_tokens_total"] - self._last_drafted
        accepted = st["spec_num_accepted_tokens_total"] - self._last_accepted
        self._last_drafted = st["spec_num_draft_tokens_total"]
        self._last_accepted = st["spec_num_accepted_tokens_total"]
        return {"draft_acceptance_rate": round(accepted / drafted, 3) if drafted else None}

    def _log_retractions(self, step: StepStats) -> None:
        for rid in step.retracted_rids:
            route = self.routes.get(rid)
            request_logger(rid, tracing.trace_id(route.headers if route else None)).info(
                "request retracted", reason="KV cache full; resumes by recomputation")

    def _log_end(self, out: TokenOut, headers: dict[str, str] | None) -> None:
        assert out.finish is not None
        rlog = request_logger(out.rid, tracing.trace_id(headers))
        if out.finish.kind == "abort":
            rlog.info("request aborted", reason=out.finish.message,
                      completion_tokens=out.completion_tokens)
        else:
            rlog.warning("request failed", error=out.finish.message)

    async def shutdown(self) -> None:
        await super().shutdown()
        self.worker.shutdown(wait=False, cancel_futures=True)
        if self.spans is not None:
            self.spans.close_all("the scheduler stopped")
