"""POST /v1/responses: a chat completion under the Responses API's bodies and events.

The request is checked and translated in `responses.py`, its bodies shaped in
`responses_render.py`; this file drives it through the gateway's `_run` like chat. Its stream is
not chat's (the renderer frames it): every SSE event has an `event:` line and a
`sequence_number`, and it ends with `response.completed` (no `data: [DONE]`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from services.gateway.protocol import APIError, sequences
from services.gateway.responses import ResponsesRequest, responses_param
from services.gateway.responses_render import ResponsesRenderer, new_id

Gateway = Any  # services.gateway.server.GatewayService (which imports this module)


async def create_response(gw: Gateway, request: web.Request) -> web.StreamResponse:
    try:
        req = await gw._body(request, ResponsesRequest)
        lora = gw._adapter(req.model)
        if gw.info.chat_template is None:
            raise APIError("this model has no chat template: use /v1/completions or "
                           "/generate, or start the server with --chat-template FILE", "input")
        req.check_unused(gw.info.chat_template)
        prompt = req.prompt()
        params = req.to_params()
        rid = new_id("resp")
        renderer = ResponsesRenderer(rid, lora or gw.model_name, req)
        msgs = sequences(rid, gw.instance_id, [prompt], params, 1, 0, lora_name=lora)
        return await gw._run(request, msgs, req.stream, renderer)
    except APIError as exc:  # the chat pipeline names chat's fields
        exc.param = responses_param(exc.param)
        raise
