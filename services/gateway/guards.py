"""What every request passes before a handler: the API keys, then the body's nesting depth.

Keys: `--api-key` opens generation and reading; where `--admin-api-key` is set, it alone opens
the routes that change server state (ending other clients' requests, dropping the cache they
share, loading and unloading LoRA adapters), and it opens everything else too."""

from __future__ import annotations

import hmac

from aiohttp import web

from common.config import ServerArgs
from services.gateway import anthropic
from services.gateway.protocol import APIError, check_json_depth

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})  # probes and scrapers
ADMIN_PATHS = frozenset({"/abort_request", "/flush_cache", "/load_lora_adapter",
                         "/unload_lora_adapter"})
X_API_KEY_PATHS = frozenset({anthropic.PATH})  # Anthropic's clients send `x-api-key: KEY`


def authorization(request: web.Request) -> str:
    """The Authorization header's value; on Anthropic's route, without one, `x-api-key`'s."""
    value = request.headers.get("Authorization", "")
    if not value and request.path in X_API_KEY_PATHS and "x-api-key" in request.headers:
        return f"Bearer {request.headers['x-api-key']}"
    return value


def _presents(authorization: str, key: str) -> bool:
    """In constant time: how much of a guess was right must not show in the answer's timing."""
    return hmac.compare_digest(authorization.encode("utf-8", "surrogateescape"),
                               f"Bearer {key}".encode("utf-8", "surrogateescape"))


def check_key(path: str, authorization: str, api_key: str | None,
              admin_key: str | None) -> None:
    """A 401 unless `authorization` (the header's value) opens `path`."""
    if path in OPEN_PATHS:
        return
    if admin_key and path in ADMIN_PATHS:
        if not _presents(authorization, admin_key):
            raise APIError("this route needs the admin API key (--admin-api-key): "
                           "Authorization: Bearer ...", None, 401, code="invalid_api_key")
        return
    if not api_key:
        return
    # both compared, whichever matches: the time taken does not say which key it was
    if not sum(_presents(authorization, k) for k in (api_key, admin_key) if k):
        raise APIError("invalid or missing API key (Authorization: Bearer ...)", None, 401,
                       code="invalid_api_key")


def middlewares(args: ServerArgs) -> list:
    @web.middleware
    async def keys(request: web.Request, handler):
        check_key(request.path, authorization(request), args.api_key, args.admin_api_key)
        return await handler(request)

    @web.middleware
    async def json_depth(request: web.Request, handler):
        """Every body, on every route, before any handler decodes it: a decoder would recurse
        as deep as the body nests (--max-request-bytes bounds the read itself)."""
        if request.can_read_body:
            check_json_depth(await request.read())
        return await handler(request)

    return [keys, json_depth]
