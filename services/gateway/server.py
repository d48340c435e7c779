"""The gateway: OpenAI-compatible and SGLang-style HTTP in front of the NATS pipeline.

This file holds the app (middlewares, routes) and the streaming driver; response bodies are
shaped in `render.py`, request bodies checked in `protocol.py`, lost stages handled in
`failover.py`, the request table kept in `tracker.py`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import structlog
from aiohttp import web

from common import tracing
from common.config import ServerArgs, lora_paths
from common.logging import get_logger
from common.messages import (
    AbortReq,
    AcceptedOut,
    BatchTextOut,
    ErrorOut,
    FlushCacheOut,
    FlushCacheReq,
    GenerateReq,
    Message,
    StatsOut,
)
from common.modelstore import model_info, prepare_model
from common.peers import PeerTable
from common.service import Service
from services.gateway import anthropic, guards, spans
from services.gateway.anthropic_render import MessagesRenderer
from services.gateway.failover import Failover
from services.gateway.lora import AdapterRoutes, AdapterTable
from services.gateway.metrics import Metrics
from services.gateway.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    abort_target,
    check_model,
    decode_body,
    error_body,
    sequences,
)
from services.gateway.render import (
    ChatRenderer,
    CompletionRenderer,
    GenerateRenderer,
    Renderer,
    decoder,
    usage,
)
from services.gateway.responses_route import create_response
from services.gateway.tracker import Event, SubRequest, Tracker, events

log = get_logger("gateway")

STAGES = ("tokenizer", "scheduler", "detokenizer")


def _json(data: dict | list, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status,
                        content_type="application/json", headers=headers)


# a route whose API has its own error body; every other route answers in OpenAI's
ERROR_BODIES = {anthropic.PATH: anthropic.error_body}


def _error(exc: APIError, path: str = "") -> web.Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return _json(ERROR_BODIES.get(path, APIError.body)(exc), exc.status, headers)


class GatewayService(Service):
    name = "gateway"

    def __init__(self, args: ServerArgs) -> None:
        super().__init__(args)
        self.info = model_info(prepare_model(args.model, args.cache_dir), args.served_model_name,
                               args.model, args.chat_template)
        self.max_model_len = args.max_model_len or self.info.max_model_len
        self.model_name = self.info.name
        self.tracker = Tracker()
        self.peers = PeerTable(args.heartbeat_timeout)
        # LoRA adapters served by `model` = the name: --lora-paths, then the schedulers' own
        self.adapters = AdapterTable(lora_paths(args), self.peers)
        self.adapter_routes = AdapterRoutes(self.bus, self.subjects, self.peers, self.adapters,
                                            self.model_name)
        self.failover = Failover(self.bus, self.subjects, self.peers, self.tracker, self.stats,
                                 args.heartbeat_timeout)
        self.metrics = Metrics(self.model_name, self.peers, self.tracker, self.failover.resumed,
                               lambda: (self.bus.reconnects, self.bus.rtt))
        self.decode = decoder(self.info.tokenizer_json)
        self.runner: web.AppRunner | None = None

    # -- bus ------------------------------------------------------------------------------------
    async def setup(self) -> None:
        await self.bus.subscribe(self.subjects.gateway(self.instance_id), self.on_output)
        await self.bus.subscribe(self.subjects.stats_all(), self.on_stats)
        connected = lambda: self.bus.connected  # noqa: E731
        self.spawn(self.peers.watch("scheduler", self.failover.scheduler_gone, connected))
        self.spawn(self.peers.watch("tokenizer", self.failover.tokenizer_gone, connected))
        self.spawn(self.failover.watch())
        self.bus.on_connection_change += [self.peers.on_connection, self.failover.on_connection]
        self.runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.args.host, self.args.port, reuse_address=True)
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
            before = self.peers.latest.get((msg.service, msg.instance_id))
            self.peers.record(msg)
            self.adapters.on_stats(msg)
            if before is not None and msg.nats_reconnects > before.nats_reconnects:
                log.info("a peer's NATS client reconnected", service=msg.service,
                         instance_id=msg.instance_id)
                self.failover.suspect_all(time.monotonic())

    def stats(self) -> StatsOut:
        s = super().stats()
        s.in_flight = len(self.tracker)
        return s

    # -- app ------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.args.max_request_bytes,
                              middlewares=[spans.middleware, self._errors_mw,
                                           *guards.middlewares(self.args)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post(anthropic.PATH, self.messages)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_get("/flush_cache", self.flush_cache)
        app.router.add_post("/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/unload_lora_adapter", self.unload_lora_adapter)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _errors_mw(self, request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as exc:
            return _error(exc, request.path)
        except web.HTTPRequestEntityTooLarge:
            return _error(APIError(
                f"the request body exceeds {self.args.max_request_bytes} bytes "
                "(--max-request-bytes)", None, 413), request.path)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error(APIError(exc.reason or "error", None, exc.status), request.path)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # noqa: BLE001 - never a bare 500 without the OpenAI error shape
            log.exception("handler failed", path=request.path)
            return _error(APIError("internal server error", None, 500), request.path)

    async def _body(self, request: web.Request, kind: type):
        if request.content_length and request.content_length > self.args.max_request_bytes:
            raise APIError(f"the request body exceeds {self.args.max_request_bytes} bytes "
                           "(--max-request-bytes)", None, 413)
        body = await request.read()
        return decode_body(body, kind)

    # -- plain routes ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        missing = [s for s in STAGES if not self.peers.alive(s)]
        if missing:
            return _json(error_body(f"not ready: no live {', '.join(missing)}",
                                    "service_unavailable"), 503)
        return _json({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        base = {"id": self.model_name, "object": "model", "created": int(self.started),
                "owned_by": "tokenline", "root": str(self.info.path),
                "max_model_len": self.max_model_len, "architecture": self.info.architecture}
        adapters = [{"id": name, "object": "model", "created": int(self.started),
                     "owned_by": "tokenline", "root": path, "parent": self.model_name,
                     "max_model_len": self.max_model_len}
                    for name, path in self.adapters.served().items()]
        return _json({"object": "list", "data": [base, *adapters]})

    def _adapter(self, model: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request asks for, by `model` or SGLang's `lora_path` (None: the
        base); a 404 naming an adapter not served (--lora-paths, /load_lora_adapter)."""
        served = self.adapters.served()
        lora = check_model(model, self.model_name, list(served))
        if lora_path is None:
            return lora
        if lora_path not in served:
            raise APIError(f"The LoRA adapter `{lora_path}` does not exist (--lora-paths, "
                           "/load_lora_adapter)",
                           "lora_path", 404, code="model_not_found")
        return lora_path

    async def server_info(self, request: web.Request) -> web.Response:
        scheds = self.peers.alive("scheduler")
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
        rid = abort_target(await request.read())
        for sub in self.tracker.unfinished() if rid is None else self.tracker.of(rid):
            sub.aborting = True
        if rid is None:
            await self.bus.publish(self.subjects.abort, AbortReq(abort_all=True,
                                                                 reason="aborted by operator"))
        for sub_rid in self.tracker.rids(rid) if rid is not None else []:
            await self.bus.publish(self.subjects.abort, AbortReq(rid=sub_rid,
                                                                 reason="aborted by request"))
        return _json({"success": True})

    async def flush_cache(self, request: web.Request) -> web.Response:
        scheds = self.peers.alive("scheduler")
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

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's and SGLang's: every scheduler reads and checks the adapter (services/gateway/
        lora.py); a refusal is a 400 naming the problem, and nothing serving changes."""
        return _json(await self.adapter_routes.load(
            await self._body(request, LoadLoraAdapterRequest)))

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        return _json(await self.adapter_routes.unload(
            await self._body(request, UnloadLoraAdapterRequest)))

    # -- the tokenizer's routes (vLLM's) --------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        """The ids a request with this prompt or these messages would be scheduled with: the
        tokenizer service encodes them, through the code a generation request passes."""
        req = await self._body(request, TokenizeRequest)
        self._adapter(req.model)  # an adapter tokenizes as its base
        msg = req.to_msg()
        if msg.messages is not None and self.info.chat_template is None:
            raise APIError("this model has no chat template: tokenize a `prompt`, or start the "
                           "server with --chat-template FILE", "messages")
        out = await self.failover.tokenize(msg)
        return _json({"count": len(out.input_ids), "max_model_len": self.max_model_len,
                      "tokens": out.input_ids, "token_strs": out.token_strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = await self._body(request, DetokenizeRequest)
        self._adapter(req.model)
        return _json({"prompt": self.decode(req.ids(self.info.vocab_size))})

    # -- generation routes ----------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._body(request, ChatCompletionRequest)
        lora = self._adapter(req.model, req.lora_path)
        if self.info.chat_template is None:  # a base model (e.g. the Gemma 3 270M GGUF)
            raise APIError("this model has no chat template: use /v1/completions or /generate, "
                           "or start the server with --chat-template FILE", "messages")
        req.check_unused(self.info.chat_template)
        prompt = req.prompt()
        params = req.to_params(self.info.vocab_size, self.args.max_stop_strings)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        renderer = ChatRenderer(rid, lora or self.model_name, self.decode, req)
        subs = sequences(rid, self.instance_id, [prompt], params, req.n, req.priority,
                         req.cache_salt, lora)
        return await self._run(request, subs, req.stream, renderer)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await create_response(self, request)  # services/gateway/responses_route.py

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API, as the chat completion it translates to."""
        req = await self._body(request, anthropic.MessagesRequest)
        lora = self._adapter(req.model)
        if self.info.chat_template is None:
            raise APIError("this model has no chat template: use /v1/completions or /generate, "
                           "or start the server with --chat-template FILE", "messages")
        chat = req.to_chat()
        prompt = chat.prompt()
        params = chat.to_params(self.info.vocab_size, self.args.max_stop_strings)
        rid = f"msg_{uuid.uuid4().hex}"
        renderer = MessagesRenderer(rid, lora or self.model_name, self.decode, chat)
        subs = sequences(rid, self.instance_id, [prompt], params, 1, 0, lora_name=lora)
        return await self._run(request, subs, req.stream, renderer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await self._body(request, CompletionRequest)
        lora = self._adapter(req.model, req.lora_path)
        prompts = req.prompts(self.info.vocab_size)
        params = req.to_params(self.info.vocab_size, self.args.max_stop_strings)
        rid = f"cmpl-{uuid.uuid4().hex}"
        renderer = CompletionRenderer(rid, lora or self.model_name, self.decode, req)
        subs = sequences(rid, self.instance_id, prompts, params, req.n, req.priority,
                         req.cache_salt, lora)
        return await self._run(request, subs, req.stream, renderer)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        req = await self._body(request, GenerateRequest)
        lora = self._adapter(None, req.lora_path)
        prompt = req.prompt()
        params = req.to_params(self.info.vocab_size, self.args.max_stop_strings)
        rid = req.rid or uuid.uuid4().hex
        if self.tracker.in_use(rid):
            raise APIError(f"rid {rid!r} is already in use", "rid")
        renderer = GenerateRenderer(rid, self.model_name, self.decode, req)
        subs = sequences(rid, self.instance_id, [prompt], params, req.sampling_params.n,
                         req.priority, req.cache_salt, lora)
        return await self._run(request, subs, req.stream, renderer)

    # -- generation -----------------------------------------------------------------------------
    async def _start(self, msgs: list[GenerateReq], headers: dict[str, str],
                     group: str) -> list[SubRequest]:
        if not self.peers.alive("scheduler") and self.peers:
            raise APIError("no scheduler is alive; retry shortly", None, 503,
                           "service_unavailable", "no_scheduler")
        subs = self.tracker.open(group, msgs, headers)
        hand_offs = [asyncio.ensure_future(self.failover.hand_off(sub)) for sub in subs]
        try:
            await asyncio.gather(*hand_offs)
        except BaseException as exc:  # none may stay behind in the tracker
            for task in hand_offs:  # a sibling still resending would move a closed request
                task.cancel()
            await self._finish(subs, group, getattr(exc, "message", "not submitted"),
                               failed=isinstance(exc, APIError))
            raise
        return subs

    async def _finish(self, subs: list[SubRequest], group: str, reason: str,
                      failed: bool = False) -> None:
        """Abort whatever has not finished (client gone, deadline, error) and forget the rest.

        `failed`: the client got an error response, not a finished or abandoned request.
        """
        if tracing.enabled():
            spans.on_end(subs, usage(subs), reason)
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
        self.tracker.close(group)

    async def _events(self, subs: list[SubRequest]) -> AsyncIterator[Event]:
        async for ev in events(subs[0].queue, subs, self.args.first_output_timeout,
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
                    raise APIError(out.finish.message or "generation failed",
                                   out.finish.param, out.finish.status or 500)
                self.metrics.observe_finished(sub, out)
            yield ev

    async def _run(self, request: web.Request, msgs: list[GenerateReq], stream: bool,
                   renderer: Renderer) -> web.StreamResponse:
        """Drive one HTTP request: stream chunks or gather the final body; abort when left."""
        group = msgs[0].rid.rsplit("-", 1)[0] if len(msgs) > 1 else msgs[0].rid
        if tracing.enabled():
            spans.on_start(msgs, self.model_name, group)
            headers = tracing.inject()
        else:  # a client's trace context still reaches every stage's log lines
            headers = tracing.passthrough(request.headers)
        # this handler's task only: every line it logs is about this request
        structlog.contextvars.bind_contextvars(rid=group, trace_id=tracing.trace_id(headers))
        subs = await self._start(msgs, headers, group)
        reason, failed = "client disconnected", False
        try:
            if not stream:
                async for _ in self._events(subs):
                    pass
                reason = "finished"
                return _json(renderer.final(subs))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
            reason = await self._stream(request, resp, subs, renderer)
            failed = reason != "finished"  # an error event after the first byte
            return resp
        except APIError as exc:
            reason, failed = exc.message, True
            raise
        finally:
            await self._finish(subs, group, reason, failed)

    async def _stream(self, request: web.Request, resp: web.StreamResponse,
                      subs: list[SubRequest], renderer: Renderer) -> str:
        """SSE: a chunk per output, the renderer's tail, `[DONE]`; returns how it ended. An
        error before the first byte is an HTTP error, after it an error event."""
        reason = "finished"
        try:
            async for ev in self._events(subs):
                chunk = renderer.chunk(subs[ev.index], ev.out)
                if chunk is None:
                    continue
                if not resp.prepared:
                    await resp.prepare(request)
                await resp.write(renderer.sse(renderer.with_usage(chunk, subs)))
            if not resp.prepared:
                await resp.prepare(request)
            for chunk in renderer.tail(subs):
                await resp.write(renderer.sse(chunk))
        except APIError as exc:
            if not resp.prepared:
                raise
            reason = exc.message
            await resp.write(renderer.error_event(exc))
        await resp.write(renderer.done())
        await resp.write_eof()
        return reason

