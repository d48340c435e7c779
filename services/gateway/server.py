"""The gateway: OpenAI-compatible and SGLang-style HTTP in front of the NATS pipeline."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import nats.errors
import structlog
from aiohttp import web

from common import tracing
from common.config import ServerArgs
from common.logging import get_logger, request_logger
from common.messages import (
    AbortReq,
    AcceptedOut,
    BatchTextOut,
    ErrorOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    Message,
    SamplingParams,
    StatsOut,
    TextOut,
)
from common.modelstore import model_info, prepare_model
from common.service import Service
from services.gateway import spans
from services.gateway.metrics import Metrics
from services.gateway.protocol import (
    MAX_N,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    build_params,
    decode_body,
    error_body,
)
from services.gateway.tracker import Event, SubRequest, Tracker, events

log = get_logger("gateway")

STAGES = ("tokenizer", "scheduler", "detokenizer")
TOKENIZER_WAIT_S = 1.0  # a request waits this long for a tokenizer (one restarting) before 503


def _json(data: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json", headers=headers)


def _error(exc: APIError) -> web.Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return _json(exc.body(), exc.status, headers)


def _finish_reason(out: TextOut | ErrorOut | None) -> str | None:
    if isinstance(out, TextOut) and out.finish is not None:
        return out.finish.kind
    return None


def _sglang_finish(fin) -> dict:
    """SGLang's shape: {"type": "stop", "matched": ...} / {"type": "length", "length": n}."""
    d: dict = {"type": fin.kind}
    if fin.matched is not None:
        d["matched"] = fin.matched
    if fin.message:
        d["message"] = fin.message
    return d


class GatewayService(Service):
    name = "gateway"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                               args.model, args.chat_template)
        self.max_model_len = args.max_model_len or self.info.max_model_len
        self.model_name = self.info.name
        self.tracker = Tracker()
        self.groups: dict[str, list[str]] = {}  # response id -> its sequences' rids
        self.peers: dict[tuple[str, str], StatsOut] = {}  # (service, id) -> latest heartbeat
        self.peer_seen: dict[tuple[str, str], float] = {}
        self.metrics = Metrics(self.model_name, self)
        self._tokenizer = None
        self.runner: web.AppRunner | None = None

    # -- bus ------------------------------------------------------------------------------------
    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.gateway(self.instance_id), self.on_output)
        await self.bus.subscribe(self.subjects.stats_all(), self.on_stats)
        self.spawn(self._watch("scheduler", self._scheduler_gone))
        self.spawn(self._watch("tokenizer", self._tokenizer_gone))
        self.bus.on_connection_change.append(self._on_nats_connection)
        app = self.make_app()
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.args.host, self.args.port,
                           reuse_address=True)
        await site.start()
        log.info("gateway listening", url=f"http://{self.args.host}:{self.args.port}")

    async def shutdown(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        await super().shutdown()

    async def on_output(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, BatchTextOut):
            for item in msg.items:
                self.tracker.deliver(item)
        elif isinstance(msg, AcceptedOut):
            self.tracker.accept(msg.rid, msg.scheduler_id)
        elif isinstance(msg, ErrorOut):
            self.tracker.deliver(msg)

    async def on_stats(self, msg: Message, headers: dict[str, str]) -> None:
        if isinstance(msg, StatsOut):
            key = (msg.service, msg.instance_id)
            self.peers[key] = msg
            self.peer_seen[key] = time.monotonic()

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.tracker)
        return s

    def alive(self, service: str) -> list[StatsOut]:
        cutoff = time.monotonic() - self.args.heartbeat_timeout
        return [s for k, s in self.peers.items()
                if k[0] == service and self.peer_seen[k] >= cutoff]

    # -- scheduler failover ---------------------------------------------------------------------
    async def _watch(self, service: str, on_lost) -> None:
        """Call `on_lost(id)` once for each instance of `service` whose heartbeats stopped;
        `on_lost` returns False when the instance turned out to be alive after all."""
        tick = min(0.25, self.args.heartbeat_timeout / 4)
        lost: set[str] = set()
        last = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            stalled, last = now - last > tick + self.args.heartbeat_timeout / 2, now
            if stalled or not self.bus.connected:  # heartbeats may be late, not missing
                continue
            known = {i for (svc, i) in self.peers if svc == service}
            dead = known - {s.instance_id for s in self.alive(service)}
            for instance_id in sorted(dead - lost):
                try:
                    if await on_lost(instance_id):
                        lost.add(instance_id)
                except Exception:  # noqa: BLE001 - the watcher must outlive one bad failover
                    log.exception("handling a lost service failed", service=service,
                                  instance_id=instance_id)
            lost &= dead  # one that comes back and dies again is handled again

    async def _scheduler_gone(self, scheduler_id: str) -> bool:
        if await self._answers(scheduler_id):
            return False  # heartbeats late, yet it is there: a busy machine, not a death
        await self._on_scheduler_lost(scheduler_id)
        return True

    async def _answers(self, scheduler_id: str) -> bool:
        """Whether a scheduler whose heartbeats are late still takes messages on its subject.

        NATS drops a closed connection's subscriptions at once, so a process that is gone
        (killed, crashed) gives 'no responders' at once; one that is alive but starved of CPU
        acknowledges the probe (our heartbeat, which it otherwise ignores)."""
        try:
            await self.bus.publish_acked(self.subjects.scheduler_instance(scheduler_id),
                                         self.stats(), timeout=self.args.heartbeat_timeout)
            return True
        except nats.errors.Error:  # no responders, or no receipt in time: hung or cut off
            return False

    async def _on_scheduler_lost(self, scheduler_id: str) -> None:
        """Move the requests a dead scheduler owned to live ones; with none left, fail them.

        A moved request resumes after the tokens this gateway already delivered (the engine
        recomputes their KV and samples by position, so greedy and seeded output continue
        exactly); `Tracker.deliver` drops the replayed text and any late output of the dead one.
        Its copy there is aborted first, in case that scheduler was only silent, not dead.
        """
        victims = self.tracker.owned_by(scheduler_id)
        if not victims:
            return
        survivors = self.alive("scheduler")
        log.warning("scheduler lost", scheduler_id=scheduler_id, requests=len(victims),
                    survivors=[s.instance_id for s in survivors])
        if not survivors:
            self._fail_unavailable(victims, "scheduler_lost",
                                   f"the scheduler serving this request ({scheduler_id}) stopped "
                                   "responding and no other scheduler is alive; retry shortly")
            return
        load = {s.instance_id: s.num_running + s.num_waiting for s in survivors}
        for sub in victims:
            target = min(load, key=load.__getitem__)
            load[target] += 1
            await self.bus.publish(self.subjects.abort, AbortReq(
                rid=sub.msg.rid, scheduler_id=scheduler_id, reason="moved to another scheduler"))
            msg = self.tracker.move(sub, target)
            request_logger(msg.rid, tracing.trace_id(sub.headers)).info(
                "request moved", scheduler_id=target, resumed_after=len(msg.output_ids))
            try:
                sub.tokenizer_id = await self._to_tokenizer(msg, sub.headers)
            except APIError as exc:
                self.tracker.deliver(ErrorOut(rid=msg.rid, message=exc.message,
                                              status=exc.status, err_type=exc.err_type,
                                              code=exc.code))

    def _fail_unavailable(self, subs: list[SubRequest], code: str, message: str) -> None:
        """End each of `subs` with a 503 the client may retry."""
        for sub in subs:
            self.tracker.deliver(ErrorOut(rid=sub.msg.rid, status=503,
                                          err_type="service_unavailable", code=code,
                                          message=message))

    # -- tokenizer loss -------------------------------------------------------------------------
    async def _tokenizer_gone(self, tokenizer_id: str) -> bool:
        self._on_tokenizer_lost(tokenizer_id)
        return True

    def _on_tokenizer_lost(self, tokenizer_id: str) -> None:
        """Fail at once the requests a dead tokenizer took but no scheduler accepted yet."""
        victims = [s for s in self.tracker.subs.values()
                   if s.tokenizer_id == tokenizer_id and s.scheduler_id is None
                   and s.finish is None and not s.finished]
        if victims:
            log.warning("tokenizer lost", tokenizer_id=tokenizer_id, requests=len(victims))
        self._fail_unavailable(victims, "tokenizer_lost",
                               f"the tokenizer handling this request ({tokenizer_id}) stopped "
                               "responding; retry shortly")

    # -- NATS loss ------------------------------------------------------------------------------
    def _on_nats_connection(self, up: bool) -> None:
        """Cut off from NATS, the gateway cannot tell what its requests' outputs were (core NATS
        delivers at most once: a stream would go on with a silent gap), so each fails now with
        a 503. Once back, every peer's silence counts from the reconnection."""
        if up:
            now = time.monotonic()
            for key in self.peer_seen:
                self.peer_seen[key] = now
            return
        victims = [s for s in self.tracker.subs.values() if s.finish is None and not s.finished]
        if victims:
            log.warning("NATS connection lost", requests=len(victims))
        self._fail_unavailable(victims, "nats_disconnected",
                               "the gateway lost its connection to NATS while this request ran; "
                               "retry shortly")

    async def _to_tokenizer(self, msg: GenerateReq, headers: dict[str, str]) -> str:
        """Hand a request to a tokenizer and return the id of the one that took it.

        Plain NATS would drop it without a word while no tokenizer listens (the only one is
        restarting); here that is a 503 after a short wait instead of a hang."""
        deadline = time.monotonic() + TOKENIZER_WAIT_S
        while True:
            try:
                receipt = await self.bus.publish_acked(self.subjects.tokenizer, msg, headers,
                                                       timeout=self.args.heartbeat_timeout)
                return receipt.instance_id
            except nats.errors.NoRespondersError:
                if time.monotonic() >= deadline:
                    raise APIError("no tokenizer is available; retry shortly", None, 503,
                                   "service_unavailable", "no_tokenizer") from None
                await asyncio.sleep(0.1)
            except nats.errors.Error as exc:  # timeout, or NATS itself is unreachable
                raise APIError(f"the request could not be handed to a tokenizer ({exc}); "
                               "retry shortly", None, 503, "service_unavailable",
                               "tokenizer_unreachable") from None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.info.tokenizer_json))
        return self._tokenizer

    # -- app ------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.args.max_request_bytes,
                              middlewares=[spans.middleware, self._errors_mw, self._auth_mw])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            return _error(exc)
        except web.HTTPRequestEntityTooLarge:
            return _error(APIError(
                f"the request body exceeds {self.args.max_request_bytes} bytes "
                "(--max-request-bytes)", None, 413))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(APIError(exc.reason or "error", None, exc.status))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # noqa: BLE001 - never a bare 500 without the OpenAI error shape
            log.exception("handler failed", path=request.path)
            return _error(APIError("internal server error", None, 500))

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler):
        key = self.args.api_key
        if key and request.path not in ("/health", "/metrics", "/openapi.json"):
            if request.headers.get("Authorization", "") != f"Bearer {key}":
                raise APIError("invalid or missing API key (Authorization: Bearer ...)", None,
                               401, code="invalid_api_key")
        return await handler(request)

    async def _body(self, request: web.Request, kind: type):
        if request.content_length and request.content_length > self.args.max_request_bytes:
            raise APIError(f"the request body exceeds {self.args.max_request_bytes} bytes "
                           "(--max-request-bytes)", None, 413)
        body = await request.read()
        return decode_body(body, kind)

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", "model", 404, code="model_not_found")

    # -- plain routes ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        missing = [s for s in STAGES if not self.alive(s)]
        if missing:
            return _json(error_body(f"not ready: no live {', '.join(missing)}",
                                    "service_unavailable"), 503)
        return _json({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": int(self.started),
            "owned_by": "tokenline", "root": str(self.info.path),
            "max_model_len": self.max_model_len, "architecture": self.info.architecture,
        }]})

    async def server_info(self, request: web.Request) -> web.Response:
        scheds = self.alive("scheduler")
        info = dict(scheds[0].info or {}) if scheds else {}
        info.setdefault("model", self.model_name)
        info.setdefault("max_model_len", self.max_model_len)
        info.setdefault("architecture", self.info.architecture)
        info["schedulers"] = [s.instance_id for s in scheds]
        info["gateway_id"] = self.instance_id
        return _json(info)

    async def metrics_route(self, request: web.Request) -> web.Response:
        if not self.args.enable_metrics:
            raise APIError("metrics are disabled (--enable-metrics)", None, 404)
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def openapi(self, request: web.Request) -> web.Response:
        from services.gateway.openapi import spec

        return _json(spec(self.model_name, api_key=bool(self.args.api_key)))

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.read()
        try:
            data = json.loads(body or b"{}")
        except (ValueError, UnicodeDecodeError):
            raise APIError("the body is not valid JSON", None) from None
        if not isinstance(data, dict):
            raise APIError("the body must be a JSON object", None)
        if data.get("abort_all") is True:
            await self.bus.publish(self.subjects.abort, AbortReq(abort_all=True,
                                                                 reason="aborted by operator"))
            return _json({"success": True})
        rid = data.get("rid")
        if not isinstance(rid, str) or not rid:
            raise APIError("give `rid` (a string) or `abort_all: true`", "rid")
        for sub_rid in self.groups.get(rid, [rid]):
            await self.bus.publish(self.subjects.abort, AbortReq(rid=sub_rid,
                                                                 reason="aborted by request"))
        return _json({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        scheds = self.alive("scheduler")
        if not scheds:
            raise APIError("no scheduler is alive", None, 503)
        replies = await self.bus.gather(self.subjects.flush_cache, FlushCacheReq(),
                                        expect=len(scheds), timeout=5.0)
        refused = [r for r in replies if isinstance(r, FlushCacheOut) and not r.ok]
        if refused:
            raise APIError(f"Cache not flushed: {refused[0].message}", None, 400)
        if len(replies) < len(scheds):
            raise APIError("not every scheduler answered the flush", None, 503)
        return _json({"success": True, "message": "Cache flushed.",
                      "schedulers": [r.scheduler_id for r in replies]})

    # -- generation -----------------------------------------------------------------------------
    def _subrequests(self, rid: str, prompts: list[dict], params: SamplingParams, n: int,
                     priority: int) -> list[GenerateReq]:
        msgs = []
        total = len(prompts) * n
        for i, prompt in enumerate(prompts):
            for j in range(n):
                p = msgspec.structs.replace(params)
                if p.seed is not None and n > 1:
                    p.seed = p.seed + j  # distinct but reproducible choices
                sub_rid = rid if total == 1 else f"{rid}-{i * n + j}"
                msgs.append(GenerateReq(
                    rid=sub_rid, gateway_id=self.instance_id, params=p, priority=priority,
                    arrival_time=time.time(), **prompt))
        return msgs

    async def _start(self, subs_msgs: list[GenerateReq], headers: dict[str, str],
                     group: str) -> tuple[asyncio.Queue, list[SubRequest]]:
        if not self.alive("scheduler") and self.peers:
            raise APIError("no scheduler is alive; retry shortly", None, 503,
                           "service_unavailable", "no_scheduler")
        queue: asyncio.Queue = asyncio.Queue()
        subs = [self.tracker.add(m, i, queue) for i, m in enumerate(subs_msgs)]
        for sub in subs:
            sub.headers = headers
        self.groups[group] = [m.rid for m in subs_msgs]
        try:
            taken_by = await asyncio.gather(*(self._to_tokenizer(m, headers) for m in subs_msgs))
        except BaseException as exc:  # none may stay behind in the tracker
            await self._finish(subs, group, getattr(exc, "message", "not submitted"),
                               failed=isinstance(exc, APIError))
            raise
        for sub, tokenizer_id in zip(subs, taken_by, strict=True):
            sub.tokenizer_id = tokenizer_id
        return queue, subs

    async def _finish(self, subs: list[SubRequest], group: str, reason: str,
                      failed: bool = False) -> None:
        """Abort whatever has not finished (client gone, deadline, error) and forget the rest.

        `failed`: the client got an error response, not a finished or abandoned request.
        """
        self.groups.pop(group, None)
        if tracing.enabled():
            spans.on_end(subs, self._usage(subs), reason)
        if reason != "finished":
            log.info("request ended early", reason=reason)
            # `_events` counted those it handed on with a stop, length or abort finish
            self.metrics.observe_ended_early(sum(
                not s.finished or s.finish is None or s.finish.kind == "error" for s in subs),
                failed)
        for sub in subs:
            # Ended by an error after a scheduler took it (its scheduler or detokenizer died):
            # the stages still alive may hold state for it, so they hear of the end too.
            failed_midway = sub.finish is None and sub.scheduler_id is not None
            if not sub.finished or failed_midway:
                sub.finished = True
                try:
                    await self.bus.publish(self.subjects.abort, AbortReq(rid=sub.msg.rid,
                                                                         reason=reason))
                except Exception:  # noqa: BLE001
                    log.warning("abort publish failed", rid=sub.msg.rid)
            self.tracker.remove(sub.msg.rid)

    async def _events(self, queue, subs) -> AsyncIterator[Event]:
        async for ev in events(queue, subs, self.args.first_output_timeout,
                               self.args.inter_output_timeout):
            if ev.out is None:
                raise APIError("the request timed out waiting for the model", None, 504,
                               code="timeout")
            out = ev.out
            if isinstance(out, ErrorOut):
                raise APIError(out.message, out.param, out.status, out.err_type, out.code)
            sub = subs[ev.index]
            sub.text += out.text
            sub.token_ids += out.token_ids
            if out.finish is not None:
                if out.finish.kind == "error":
                    raise APIError(out.finish.message or "generation failed", None,
                                   out.finish.status or 500)
                self.metrics.observe_finished(sub, out)
            yield ev

    async def _run(self, request: web.Request, subs_msgs: list[GenerateReq], stream: bool,
                   render_chunk, render_final, stream_tail) -> web.StreamResponse:
        """Drive one HTTP request: stream chunks or gather the final body; abort when left."""
        group = subs_msgs[0].rid.rsplit("-", 1)[0] if len(subs_msgs) > 1 else subs_msgs[0].rid
        if tracing.enabled():
            spans.on_start(subs_msgs, self.model_name, group)
            headers = tracing.inject()
        else:  # a client's trace context still reaches every stage's log lines
            headers = tracing.passthrough(request.headers)
        # this handler's task only: every line it logs is about this request
        structlog.contextvars.bind_contextvars(rid=group, trace_id=tracing.trace_id(headers))
        queue, subs = await self._start(subs_msgs, headers, group)
        reason, failed = "client disconnected", False
        try:
            if not stream:
                async for _ in self._events(queue, subs):
                    pass
                reason = "finished"
                return _json(render_final(subs))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            started = False
            try:
                async for ev in self._events(queue, subs):
                    chunk = render_chunk(subs[ev.index], ev.out)
                    if chunk is None:
                        continue
                    if not started:
                        await resp.prepare(request)
                        started = True
                    await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                if not started:
                    await resp.prepare(request)
                    started = True
                for chunk in stream_tail(subs):
                    await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
                reason = "finished"
            except APIError as exc:
                if not started:
                    raise
                reason, failed = exc.message, True
                await resp.write(b"data: " + msgspec.json.encode(exc.body()) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        except APIError as exc:
            reason, failed = exc.message, True
            raise
        finally:
            await self._finish(subs, group, reason, failed)

    # -- OpenAI chat ----------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        self._check_model(req.model)
        if self.info.chat_template is None:  # a base model (e.g. the Gemma 3 270M GGUF)
            raise APIError("this model has no chat template: use /v1/completions or /generate, "
                           "or start the server with --chat-template FILE", "messages")
        if not req.messages:
            raise APIError("messages must not be empty", "messages")
        self._check_messages(req.messages)
        if req.n < 1 or req.n > MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(f"top_logprobs must be in [0, 20], got {req.top_logprobs}",
                           "top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        params = self._params(req, max_tokens,
                              (req.top_logprobs or 0) if req.logprobs else None,
                              "max_completion_tokens" if req.max_completion_tokens is not None
                              else "max_tokens")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = {"messages": req.messages, "add_generation_prompt": req.add_generation_prompt}
        subs = self._subrequests(rid, [prompt], params, req.n, req.priority)
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        want_lp = req.logprobs

        def base(choices: list, usage: dict | None = None, obj="chat.completion.chunk") -> dict:
            d = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is not None or obj == "chat.completion":
                d["usage"] = usage
            return d

        sent_role: set[int] = set()

        def chunk(sub: SubRequest, out: TextOut):
            delta: dict = {}
            if sub.index not in sent_role:  # the first chunk of each choice names the role
                sent_role.add(sub.index)
                delta = {"role": "assistant", "content": ""}
            if out.text:
                delta["content"] = out.text
            reason = _finish_reason(out)
            if not delta and not reason and not (want_lp and out.logprobs):
                return None
            return base([{
                "index": sub.index, "delta": delta,
                "logprobs": self._chat_logprobs(out.logprobs) if want_lp else None,
                "finish_reason": reason,
            }])

        def tail(subs_: list[SubRequest]):
            if include_usage:
                yield base([], self._usage(subs_))

        def final(subs_: list[SubRequest]) -> dict:
            choices = []
            for s in subs_:
                lps = self._chat_logprobs(s.all_logprobs) if want_lp else None
                choices.append({"index": s.index,
                                "message": {"role": "assistant", "content": s.text},
                                "logprobs": lps, "finish_reason": s.finish_reason})
            return base(choices, self._usage(subs_), obj="chat.completion")

        return await self._run(request, subs, req.stream, chunk, final, tail)

    # -- OpenAI completions ---------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req: CompletionRequest = await self._body(request, CompletionRequest)
        self._check_model(req.model)
        if req.n < 1 or req.n > MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}], got {req.n}", "n")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of other than n is not supported", "best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(f"logprobs must be in [0, 20], got {req.logprobs}", "logprobs")
        if req.suffix:
            raise APIError("suffix is not supported", "suffix")
        prompts = self._prompts(req.prompt)
        params = self._params(req, 16 if req.max_tokens is None else req.max_tokens,
                              req.logprobs, "max_tokens")
        rid = f"cmpl-{uuid.uuid4().hex}"
        subs = self._subrequests(rid, prompts, params, req.n, req.priority)
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        echo_done: set[int] = set()

        def echo_text(sub: SubRequest) -> str:
            if sub.msg.text is not None:
                return sub.msg.text
            return self.tokenizer.decode(sub.msg.input_ids or [], skip_special_tokens=False)

        def base(choices, usage=None, obj="text_completion"):
            d = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                 "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return d

        def chunk(sub: SubRequest, out: TextOut):
            text = out.text
            if req.echo and sub.index not in echo_done:
                echo_done.add(sub.index)
                text = echo_text(sub) + text
            reason = _finish_reason(out)
            if not text and not reason:
                return None
            lps = self._completion_logprobs(out.logprobs) if req.logprobs is not None else None
            return base([{"index": sub.index, "text": text, "logprobs": lps,
                          "finish_reason": reason}])

        def tail(subs_):
            if include_usage:
                yield base([], self._usage(subs_))

        def final(subs_):
            choices = []
            for s in subs_:
                text = (echo_text(s) if req.echo else "") + s.text
                lps = (self._completion_logprobs(s.all_logprobs) if req.logprobs is not None
                       else None)
                choices.append({"index": s.index, "text": text, "logprobs": lps,
                                "finish_reason": s.finish_reason})
            return base(choices, self._usage(subs_))

        return await self._run(request, subs, req.stream, chunk, final, tail)

    def _prompts(self, prompt) -> list[dict]:
        if isinstance(prompt, str):
            return [{"text": prompt}]
        if not prompt:
            raise APIError("prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in prompt):
            return [{"input_ids": self._token_ids(prompt)}]
        if len(prompt) > MAX_N:
            raise APIError(f"at most {MAX_N} prompts per request", "prompt")
        out = []
        for x in prompt:
            if isinstance(x, str):
                out.append({"text": x})
            elif isinstance(x, list) and x and all(isinstance(t, int) for t in x):
                out.append({"input_ids": self._token_ids(x)})
            else:
                raise APIError("prompt must be a string, a list of strings, a list of token "
                               "ids, or a list of such lists", "prompt")
        return out

    def _token_ids(self, ids: list) -> list[int]:
        for t in ids:
            if type(t) is not int:  # a bool is an int to Python, not to the tokenizer
                raise APIError(f"prompt token ids must be integers, got {t!r}", "prompt")
            if not 0 <= t < self.info.vocab_size:
                raise APIError(f"token id {t} is outside the vocabulary "
                               f"[0, {self.info.vocab_size})", "prompt")
        return list(ids)

    @staticmethod
    def _check_messages(messages: list) -> None:
        """Refuse here what could not even reach the tokenizer (it checks roles and content)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise APIError(f"messages[{i}] must be an object", f"messages[{i}]")
        try:
            msgspec.msgpack.encode(messages)
        except (OverflowError, TypeError) as exc:  # e.g. an integer beyond 64 bits
            raise APIError(f"messages cannot be sent on: {exc}", "messages") from None

    def _params(self, req, max_tokens, logprobs, max_tokens_param) -> SamplingParams:
        return build_params(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            top_k=req.top_k, min_p=req.min_p, seed=req.seed,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=req.logit_bias, stop=req.stop,
            stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            vocab_size=self.info.vocab_size, max_stops=self.args.max_stop_strings,
            max_tokens_param=max_tokens_param,
        )

    # -- SGLang /generate -----------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        req: GenerateRequest = await self._body(request, GenerateRequest)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("give exactly one of `text` or `input_ids`", "text")
        sp = req.sampling_params
        if sp.n < 1 or sp.n > MAX_N:
            raise APIError(f"n must be in [1, {MAX_N}]", "sampling_params.n")
        if req.top_logprobs_num < 0 or req.top_logprobs_num > 20:
            raise APIError("top_logprobs_num must be in [0, 20]", "top_logprobs_num")
        try:
            params = build_params(
                max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                top_k=sp.top_k, min_p=sp.min_p, seed=sp.seed,
                presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
                repetition_penalty=sp.repetition_penalty, logit_bias=sp.logit_bias,
                stop=sp.stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                min_tokens=sp.min_new_tokens, skip_special_tokens=sp.skip_special_tokens,
                include_stop_str_in_output=sp.include_stop_str_in_output,
                logprobs=req.top_logprobs_num if req.return_logprob else None,
                vocab_size=self.info.vocab_size, max_stops=self.args.max_stop_strings,
                max_tokens_param="max_new_tokens",
            )
        except APIError as exc:
            exc.param = f"sampling_params.{exc.param}" if exc.param else exc.param
            raise
        rid = req.rid or uuid.uuid4().hex
        if rid in self.groups or rid in self.tracker.subs:
            raise APIError(f"rid {rid!r} is already in use", "rid")
        prompt = {"text": req.text} if req.text is not None else {"input_ids": req.input_ids}
        subs = self._subrequests(rid, [prompt], params, sp.n, req.priority)

        def meta(sub: SubRequest, out: TextOut | None) -> dict:
            fin = sub.finish
            m = {"id": sub.msg.rid, "prompt_tokens": sub.prompt_tokens,
                 "completion_tokens": len(sub.token_ids), "cached_tokens": sub.cached_tokens,
                 "finish_reason": None if fin is None else _sglang_finish(fin),
                 "e2e_latency": time.monotonic() - sub.arrival}
            if req.return_logprob:
                m["output_token_logprobs"] = [[lp.logprob, lp.token_id]
                                              for lp in sub.all_logprobs]
                if req.top_logprobs_num:
                    m["output_top_logprobs"] = [[[v, t] for t, v in lp.top]
                                                for lp in sub.all_logprobs]
            return m

        def one(sub: SubRequest) -> dict:
            return {"text": sub.text, "output_ids": sub.token_ids, "index": sub.index,
                    "meta_info": meta(sub, None)}

        def chunk(sub: SubRequest, out: TextOut):
            if not out.text and out.finish is None:
                return None
            return one(sub)  # SGLang streams the cumulative text

        def final(subs_):
            return one(subs_[0]) if len(subs_) == 1 else [one(s) for s in subs_]

        def tail(subs_):
            return iter(())

        return await self._run(request, subs, req.stream, chunk, final, tail)

    # -- rendering helpers ----------------------------------------------------------------------
    def _usage(self, subs: list[SubRequest]) -> dict:
        seen: set[str] = set()
        prompt = cached = 0
        for s in subs:  # a prompt shared by n choices counts once
            key = s.msg.text if s.msg.text is not None else repr(s.msg.messages or s.msg.input_ids)
            if key not in seen:
                seen.add(key)
                prompt += s.prompt_tokens
                cached += s.cached_tokens
        completion = sum(len(s.token_ids) for s in subs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _chat_logprobs(self, lps) -> dict | None:
        if lps is None:
            return None
        content = []
        for lp in lps:
            tok = self._token_str(lp.token_id)
            content.append({
                "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [{"token": (t := self._token_str(i)), "logprob": v,
                                  "bytes": list(t.encode())} for i, v in lp.top],
            })
        return {"content": content}

    def _completion_logprobs(self, lps) -> dict | None:
        if lps is None:
            return None
        tokens = [self._token_str(lp.token_id) for lp in lps]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token_str(i): v for i, v in lp.top} for lp in lps],
                "text_offset": offsets}
