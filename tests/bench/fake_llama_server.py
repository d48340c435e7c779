"""A stand-in for llama.cpp's `llama-server`, for testing `tokenline bench peers` without it.

It takes llama-server's flags, serves /health (503 for a moment, as while a model loads),
/v1/models and streamed /v1/completions, and generates `max_tokens` tokens, except that a prompt
whose first token id is odd gets one token fewer: the peer benchmark must see those as short.
It sends no usage block, so the client counts content chunks, one per token.

For LoRA (`bench peers --lora-adapters`) it can also serve adapter names beside the model
(`--fake-adapter NAME`, repeated; a request naming another model is a 404) and a prefix cache
flush route (`--fake-flush-route PATH`). With $FAKE_REQUESTS_RECORD set, its start, each
request's model and each flush go there as JSON lines, with the server's `-m`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

from aiohttp import web

LOAD_S = 0.3


def _record(**event: object) -> None:
    path = os.environ.get("FAKE_REQUESTS_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def make_app(model: str, slots: int, adapters: tuple[str, ...] = (),
             flush_route: str | None = None, flags: tuple[str, ...] = ()) -> web.Application:
    """/health, /v1/models and streamed /v1/completions for `model` and `adapters`, `slots`
    requests at a time, and POST `flush_route` (also the fake vLLM's app: fake_vllm.py)."""
    started = time.monotonic()
    running = asyncio.Semaphore(slots)
    _record(server=model, start=True, flags=list(flags))

    async def health(request: web.Request) -> web.Response:
        if time.monotonic() - started < LOAD_S:
            return web.json_response({"error": {"message": "Loading model"}}, status=503)
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list",
                                  "data": [{"id": name} for name in (model, *adapters)]})

    async def flush(request: web.Request) -> web.Response:
        _record(server=model, flush=True)
        return web.json_response({"success": True})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("model") not in (model, *adapters):
            return web.json_response({"error": {"message": f"no model {body.get('model')}"}},
                                     status=404)
        _record(server=model, model=body["model"])
        prompt = body["prompt"]
        n = body["max_tokens"] - (1 if isinstance(prompt, list) and prompt[0] % 2 else 0)
        async with running:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(n):
                await asyncio.sleep(0.001)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    if flush_route:
        app.router.add_post(flush_route, flush)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("-m", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("-c", type=int)
    p.add_argument("-np", type=int, default=1)
    p.add_argument("-t", type=int)
    p.add_argument("--fake-adapter", action="append", default=[])
    p.add_argument("--fake-flush-route")
    args, flags = p.parse_known_args()  # the rest as llama-server's own flags, recorded
    web.run_app(make_app(args.m, args.np, tuple(args.fake_adapter), args.fake_flush_route,
                         tuple(flags)),
                host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
