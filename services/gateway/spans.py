"""The gateway's span: one SERVER span per generation request, the root of the request's trace.

Its context goes to the tokenizer and scheduler in the `traceparent` NATS header; a client's
own `traceparent` makes it a child of the client's span.
"""

from __future__ import annotations

from aiohttp import web

from common import tracing
from common.messages import GenerateReq
from services.gateway.tracker import SubRequest

TRACED_ROUTES = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/generate": "text_completion",
}


@web.middleware
async def middleware(request: web.Request, handler):
    operation = TRACED_ROUTES.get(request.path)
    if operation is None or not tracing.enabled():
        return await handler(request)
    route = request.path
    span = tracing.start_span(
        f"{request.method} {route}", tracing.extract(request.headers), "server",
        {"http.request.method": request.method, "http.route": route, "url.path": request.path,
         tracing.OPERATION_NAME: operation},
    )
    status: int | None = None
    try:
        with tracing.use_span(span):
            response = await handler(request)
        status = response.status
        return response
    finally:
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:  # HTTP convention: a 4xx is the client's, not the server's, error
                tracing.set_error(span, f"HTTP {status}", str(status))
        span.end()


def on_start(subs: list[GenerateReq], model: str, group: str) -> None:
    """What was asked, on the current request's span."""
    span = tracing.current_span()
    if span is None:
        return
    span.set_attributes({tracing.RID: group, tracing.RESPONSE_ID: group,
                         tracing.REQUEST_MODEL: model,
                         **tracing.request_attributes(subs[0].params)})
    if len(subs) > 1:
        span.set_attribute("gen_ai.request.choice.count", len(subs))
    if subs[0].lora_name is not None:
        span.set_attribute(tracing.LORA_NAME, subs[0].lora_name)


def on_end(subs: list[SubRequest], usage: dict, reason: str) -> None:
    """How it ended: a sequence the gateway gives up on (client gone, deadline) is aborted."""
    span = tracing.current_span()
    if span is None:
        return
    kinds = [s.finish.kind if s.finish is not None else "error" if s.finished else "abort"
             for s in subs]
    span.set_attributes({
        tracing.FINISH_REASONS: kinds,
        **tracing.usage_attributes(usage["prompt_tokens"], usage["completion_tokens"],
                                   usage["prompt_tokens_details"]["cached_tokens"],
                                   sum(s.retractions for s in subs)),
    })
    for sub, kind in zip(subs, kinds, strict=True):
        if kind in ("abort", "error"):
            message = sub.finish.message if sub.finish is not None else None
            tracing.set_error(span, message or reason, kind)
            break
