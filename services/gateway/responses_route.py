"""POST /v1/responses: a chat completion under the Responses API's bodies and events.

The request is checked and translated in `responses.py`, its bodies shaped in
`responses_render.py`; this file drives it through the gateway's `_run`, with a stream writer of
its own. Its stream is not chat's: every SSE event has an `event:`
line and a `sequence_number`, and it ends with `response.completed` (no `data: [DONE]`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from services.gateway.protocol import APIError, check_model, sequences
from services.gateway.responses import ResponsesRequest, responses_param
from services.gateway.responses_render import ResponsesRenderer, new_id

Gateway = Any  # services.gateway.server.GatewayService (which imports this module)


def _frames(events: list[dict]) -> bytes:
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + msgspec.json.encode(e)
                    + b"\n\n" for e in events)


async def create_response(gw: Gateway, request: web.Request) -> web.StreamResponse:
    try:
        req = await gw._body(request, ResponsesRequest)
        check_model(req.model, gw.model_name)
        if gw.info.chat_template is None:
            raise APIError("this model has no chat template: use /v1/completions or "
                           "/generate, or start the server with --chat-template FILE", "input")
        req.check_unused(gw.info.chat_template)
        prompt = req.prompt()
        params = req.to_params()
        rid = new_id("resp")
        renderer = ResponsesRenderer(rid, gw.model_name, req)
        msgs = sequences(rid, gw.instance_id, [prompt], params, 1, 0)
        if not req.stream:
            return await gw._run(request, msgs, False, renderer)
        return await gw._run(request, msgs, True, renderer, partial(_stream, gw))
    except APIError as exc:  # the chat pipeline names chat's fields
        exc.param = responses_param(exc.param)
        raise


async def _stream(gw: Gateway, request: web.Request, resp: web.StreamResponse, subs: list,
                  renderer: ResponsesRenderer) -> str:
    """An error before the first byte is an HTTP error, after it an `error` event."""
    reason = "finished"
    try:
        async for ev in gw._events(subs):
            events = renderer.events(subs[ev.index], ev.out)
            if not events:
                continue
            if not resp.prepared:
                await resp.prepare(request)
            await resp.write(_frames(events))
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(_frames(renderer.end(subs)))
    except APIError as exc:
        if not resp.prepared:
            raise
        reason = exc.message
        await resp.write(_frames([renderer.event("error", {
            "code": exc.code or exc.err_type, "message": exc.message,
            "param": responses_param(exc.param)})]))
    await resp.write_eof()
    return reason
