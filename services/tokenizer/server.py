"""The tokenizer service: GenerateReq in, TokenizedReq out to a scheduler (or an error back).

It also routes: with several schedulers, `Router` picks the one that holds the request's
prefix (from the schedulers' KV events and heartbeats) and the request goes to that one's own
subject; if it does not answer, to the queue group, as with `--load-balance-method random`.
"""

from __future__ import annotations

import time

import nats.errors
import structlog

from common import tracing
from common.config import ServerArgs
from common.logging import get_logger, request_logger
from common.messages import (
    AbortReq,
    ErrorOut,
    GenerateReq,
    KvEventsOut,
    KvSnapshotOut,
    KvSnapshotReq,
    Message,
    StatsOut,
    TokenizedReq,
    TokenizeOut,
    TokenizeReq,
)
from common.modelstore import model_info, prepare_model
from common.peers import silence_rounds
from common.service import Service
from common.subjects import TOKENIZER_QUEUE
from services.tokenizer.router import Router
from services.tokenizer.tokenize import InputError, TextTokenizer

log = get_logger("tokenizer")

ABORT_MEMORY_S = 30.0


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                               args.model, args.chat_template)
        self.max_model_len = args.max_model_len or self.info.max_model_len
        self.tok = TextTokenizer(self.info)
        self.in_flight: set[str] = set()
        self.aborted: dict[str, float] = {}
        self.router = Router(args.load_balance_method, args.cache_threshold,
                             args.balance_abs_threshold, args.balance_rel_threshold,
                             args.heartbeat_timeout)

    async def setup(self) -> None:
        if self.router.method != "random":  # random is the queue group's pick: no views needed
            await self.bus.subscribe(self.subjects.kv_events(), self.on_kv_events)
            await self.bus.subscribe(self.subjects.stats_all("scheduler"), self.on_sched_stats)
            self.spawn(self._expire_views())
            self.bus.on_connection_change.append(
                lambda up: self.router.on_connection(up, time.monotonic()))
        # unordered: a request whose scheduler died on the way waits seconds for a receipt,
        # and the requests behind it must not wait (unacknowledged: the gateway 503s them)
        await self.bus.subscribe(self.subjects.tokenizer, self.on_request, queue=TOKENIZER_QUEUE,
                                 ordered=False)
        await self.bus.subscribe(self.subjects.abort, self.on_abort)
        await self.bus.subscribe_requests(self.subjects.tokenize, self.on_tokenize,
                                          queue=TOKENIZER_QUEUE)

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.in_flight)
        s.route_decisions_total = dict(self.router.decisions)
        s.router_view = self.router.view_sizes()
        s.kv_snapshots_total = self.router.snapshots_total
        return s

    # -- the router's view ----------------------------------------------------------------------
    async def on_kv_events(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, KvEventsOut) and self.router.on_events(msg, time.monotonic()):
            self._ask_snapshot(msg.scheduler_id, "events missed")

    async def on_sched_stats(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, StatsOut) and self.router.on_heartbeat(msg, time.monotonic()):
            self._ask_snapshot(msg.instance_id, "no view yet, or behind its heartbeat")

    def _ask_snapshot(self, scheduler_id: str, why: str) -> None:
        self.router.snapshot_sent(scheduler_id)
        log.info("asking for a KV snapshot", scheduler_id=scheduler_id, why=why)
        self.spawn(self._snapshot(scheduler_id))

    async def _snapshot(self, scheduler_id: str) -> None:
        snap: KvSnapshotOut | None = None
        try:
            reply = await self.bus.request(self.subjects.kv_snapshot(scheduler_id),
                                           KvSnapshotReq(), timeout=self.args.heartbeat_timeout)
            if isinstance(reply, KvSnapshotOut):
                snap = reply
        except Exception as exc:  # noqa: BLE001 - no answer: the next heartbeat asks again
            log.warning("KV snapshot failed", scheduler_id=scheduler_id, error=str(exc))
        if self.router.on_snapshot(snap, scheduler_id):
            self._ask_snapshot(scheduler_id, "events missed while catching up")

    async def _expire_views(self) -> None:
        async for _ in silence_rounds(self.args.heartbeat_timeout, lambda: self.bus.connected):
            for scheduler_id in self.router.expire(time.monotonic()):
                log.info("scheduler dropped from the routing view", scheduler_id=scheduler_id)

    async def on_abort(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, AbortReq) and msg.rid and msg.scheduler_id is None:
            now = time.monotonic()
            self.aborted[msg.rid] = now + ABORT_MEMORY_S
            self.aborted = {r: t for r, t in self.aborted.items() if t > now}

    async def on_tokenize(self, msg: Message) -> Message:
        """/tokenize: the ids a request with this prompt would be scheduled with."""
        if not isinstance(msg, TokenizeReq):
            return ErrorOut(rid="tokenize", message=f"not a TokenizeReq: {type(msg).__name__}",
                            status=500, err_type="server_error")
        try:
            if msg.messages is not None:
                ids = self.tok.encode_chat(msg.messages, msg.add_generation_prompt, msg.tools,
                                           self.args.tool_call_parser, msg.add_special_tokens)
            else:
                ids = self.tok.encode(msg.text or "", msg.add_special_tokens)
        except InputError as exc:
            return ErrorOut(rid="tokenize", message=str(exc), status=exc.status,
                            param=exc.param)
        except Exception as exc:  # noqa: BLE001 - a bug here is a 500, never a silent timeout
            log.exception("tokenize failed")
            return ErrorOut(rid="tokenize", message=f"tokenization failed: {exc}", status=500,
                            err_type="server_error")
        return TokenizeOut(input_ids=ids,
                           token_strs=self.tok.token_strs(ids) if msg.return_token_strs else None)

    async def on_request(self, msg: Message, headers: dict[str, str]) -> None:
        if not isinstance(msg, GenerateReq):
            return
        self.in_flight.add(msg.rid)
        try:
            if msg.rid in self.aborted:
                return  # the scheduler never hears of it
            with structlog.contextvars.bound_contextvars(rid=msg.rid,
                                                         trace_id=tracing.trace_id(headers)):
                try:
                    out = self._traced_tokenize(msg, headers)
                except InputError as exc:
                    log.info("request rejected", error=str(exc), param=exc.param)
                    await self.bus.publish(
                        self.subjects.gateway(msg.gateway_id),
                        ErrorOut(rid=msg.rid, message=str(exc), status=exc.status,
                                 param=exc.param),
                        headers,
                    )
                    return
                except Exception as exc:  # noqa: BLE001 - a bug here must not lose the request
                    log.exception("tokenization failed")
                    await self.bus.publish(self.subjects.gateway(msg.gateway_id), ErrorOut(
                        rid=msg.rid, message=f"tokenization failed: {exc}", status=500,
                        err_type="server_error"), headers)
                    return
            await self._hand_off(msg, out, headers)
        finally:
            self.in_flight.discard(msg.rid)

    async def _hand_off(self, msg: GenerateReq, out: TokenizedReq,
                        headers: dict[str, str]) -> None:
        """To the scheduler the router picks, on its own subject; if it does not listen (gone
        since its last heartbeat), to the queue group at once. A request whose receipt is late
        falls back only once a probe finds nobody there: it may still arrive, and no two
        schedulers may run one request."""
        if msg.scheduler_id:  # moved off a dead scheduler: the gateway picked this one
            await self._forward(self.subjects.scheduler_instance(msg.scheduler_id), out, headers)
            return
        route = self.router.route(out.input_ids, time.monotonic(), out.cache_salt,
                                  out.lora_name)
        if route.scheduler_id is not None:
            out.predicted_cached_tokens = route.predicted_tokens
            try:
                await self.bus.publish_acked(self.subjects.scheduler_instance(route.scheduler_id),
                                             out, headers, timeout=self.args.heartbeat_timeout)
                return
            except nats.errors.Error as exc:
                # No receipt in time may be a scheduler killed while the request was on its
                # way: if nobody listens there now, nobody will run it there either.
                subject = self.subjects.scheduler_instance(route.scheduler_id)
                if not isinstance(exc, nats.errors.NoRespondersError) and await self.bus.probe(
                        subject, self.stats(), self.args.heartbeat_timeout) is not False:
                    await self._not_forwarded(out, headers, exc)
                    return
                request_logger(out.rid, tracing.trace_id(headers)).info(
                    "routed scheduler gone; the queue group takes it",
                    scheduler_id=route.scheduler_id)
                self.router.fell_back(route)
                out.predicted_cached_tokens = None
        await self._forward(self.subjects.scheduler, out, headers)

    async def _forward(self, subject: str, out: TokenizedReq, headers: dict[str, str]) -> None:
        """To a scheduler, with a receipt: when none listens (the only one is restarting, or the
        one a moved request is pinned to is gone) the gateway hears so at once, not never."""
        try:
            await self.bus.publish_acked(subject, out, headers,
                                         timeout=self.args.heartbeat_timeout)
            return
        except nats.errors.Error as exc:
            await self._not_forwarded(out, headers, exc)

    async def _not_forwarded(self, out: TokenizedReq, headers: dict[str, str],
                             exc: nats.errors.Error) -> None:
        if isinstance(exc, nats.errors.NoRespondersError):
            message, code = "no scheduler is available; retry shortly", "no_scheduler"
        else:  # no receipt in time, or NATS is unreachable
            message = f"the request could not be handed to a scheduler ({exc}); retry shortly"
            code = "scheduler_unreachable"
        request_logger(out.rid, tracing.trace_id(headers)).warning("request not forwarded",
                                                                  error=message)
        await self.bus.publish(self.subjects.gateway(out.gateway_id), ErrorOut(
            rid=out.rid, message=message, status=503, err_type="service_unavailable", code=code),
            headers)

    def _traced_tokenize(self, msg: GenerateReq, headers: dict[str, str]) -> TokenizedReq:
        parent = tracing.extract(headers) if tracing.enabled() else None
        if parent is None:
            return self.tokenize(msg)
        # The scheduler's spans hang under the gateway's, not this one: the headers go on as
        # they came, so each stage's part of the request sits side by side under the request.
        span = tracing.start_span("tokenize", parent, "consumer", {tracing.RID: msg.rid})
        try:
            out = self.tokenize(msg)
        except Exception as exc:  # the span ends with the request's error, whatever it was
            kind = "invalid_request" if isinstance(exc, InputError) else "server_error"
            tracing.set_error(span, str(exc), kind)
            span.end()
            raise
        span.set_attribute(tracing.USAGE_INPUT_TOKENS, len(out.input_ids))
        span.end()
        return out

    def tokenize(self, msg: GenerateReq) -> TokenizedReq:
        if msg.input_ids is not None:
            ids = list(msg.input_ids)
            bad = next((t for t in ids if not 0 <= t < self.info.vocab_size), None)
            if bad is not None:
                raise InputError(f"token id {bad} is outside the vocabulary "
                                 f"[0, {self.info.vocab_size})", "prompt")
        elif msg.messages is not None:
            ids = self.tok.encode_chat(msg.messages, msg.add_generation_prompt, msg.tools,
                                       self.args.tool_call_parser)
        else:
            ids = self.tok.encode(msg.text or "")
        if not ids:
            raise InputError("the prompt is empty", "prompt")
        params = msg.params
        room = self.max_model_len - len(ids)
        if room <= 0:  # no room for even one token, whatever max_tokens says
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your prompt has {len(ids)} tokens.",
                "messages" if msg.messages is not None else "prompt")
        if params.max_new_tokens is None:
            params.max_new_tokens = room
        elif len(ids) + params.max_new_tokens > self.max_model_len:
            raise InputError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_new_tokens} tokens ({len(ids)} in the "
                f"prompt, {params.max_new_tokens} for the completion). Please reduce the prompt "
                "or max_tokens.",
                "max_tokens",
            )
        return TokenizedReq(
            rid=msg.rid,
            gateway_id=msg.gateway_id,
            input_ids=ids,
            params=params,
            priority=msg.priority,
            arrival_time=msg.arrival_time,
            output_ids=msg.output_ids,
            cache_salt=msg.cache_salt,
            lora_name=msg.lora_name,
        )
