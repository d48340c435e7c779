"""GET /openapi.json: every route, its body and its answers.

The request bodies' schemas come from the Structs in `protocol.py` (msgspec writes them, ranges
included), so the document cannot drift from what the server decodes. Only what the Structs
leave loose on purpose (`messages`, `prompt`, whose items are checked by hand) is described
here in more detail.
"""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.anthropic import MessagesRequest
from services.gateway.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from services.gateway.responses import (
    MAX_INPUT_ITEMS,
    MAX_TOOLS,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ResponsesRequest,
)

REF = "#/components/schemas/{name}"
ROLES = ["system", "user", "assistant", "tool", "developer"]


def _ref(name: str) -> dict:
    return {"$ref": REF.format(name=name)}


ERROR_RESPONSE = {
    "title": "ErrorResponse",
    "type": "object",
    "description": "OpenAI's error body; `param` names the offending field when there is one.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
            },
        }
    },
}

ANTHROPIC_ERROR_RESPONSE = {
    "title": "AnthropicErrorResponse",
    "type": "object",
    "description": "Anthropic's error body (/v1/messages); the message names the field.",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}},
    },
}

CHAT_MESSAGE = {
    "title": "ChatMessage",
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ROLES},
        "content": {"anyOf": [
            {"type": "string"},
            {"type": "array", "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"type": "string", "enum": ["text"]},
                               "text": {"type": "string"}},
            }},
            {"type": "null"},
        ]},
        "name": {"type": "string"},
        "tool_calls": {
            "description": "an assistant's earlier calls, rendered into the prompt",
            "type": "array", "items": {
                "type": "object", "required": ["function"],
                "properties": {
                    "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"], "properties": {
                        "name": {"type": "string"},
                        "arguments": {"type": "string", "description": "JSON text"}}},
                }}},
        "tool_call_id": {"type": "string", "description": "a `tool` message: the call it answers"},
    },
}

TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
TEXT = {"type": "string", "minLength": 1}
PROMPT = {
    "description": "a string, token ids, or a list of either (at most "
                   f"{MAX_N} prompts)",
    "anyOf": [
        TEXT,
        TOKEN_IDS,
        {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": TEXT},
        {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": TOKEN_IDS},
    ],
}

ABORT_REQUEST = {
    "title": "AbortRequest",
    "type": "object",
    "description": "give `rid` (the id a response carries) or `abort_all: true`",
    "properties": {"rid": {"type": "string", "minLength": 1}, "abort_all": {"type": "boolean"}},
    "additionalProperties": False,
}

OBJECT = {"type": "object"}

LORA_ADAPTER_RESPONSE = {
    "title": "LoraAdapterResponse",
    "type": "object",
    "properties": {"success": {"type": "boolean"}, "message": {"type": "string"},
                   "loaded_adapters": {"type": "object", "description": "name -> path",
                                       "additionalProperties": {"type": "string"}}},
    "required": ["success", "message", "loaded_adapters"],
}

TOKENIZE_RESPONSE = {
    "title": "TokenizeResponse",
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": {"type": "integer"},
        "max_model_len": {"type": "integer"},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"description": "each id's vocabulary piece, with return_token_strs",
                       "anyOf": [{"type": "array", "items": {"type": "string"}},
                                 {"type": "null"}]},
    },
}

DETOKENIZE_RESPONSE = {
    "title": "DetokenizeResponse",
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def _json(schema: dict, description: str = "OK") -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int, body: str = "ErrorResponse") -> dict:
    described = {
        400: "invalid request (the message and `param` say which field)",
        401: "missing or wrong API key",
        404: "unknown model",
        413: "body larger than --max-request-bytes",
        503: "overloaded (see Retry-After) or a stage is unavailable",
        504: "no output in time",
    }
    return {str(s): _json(_ref(body), described[s]) for s in statuses}


OPENAI_STREAM = ("OK; with `stream: true` Server-Sent Events ending in `data: [DONE]` (an "
                 "error mid-stream is an `{\"error\": ...}` event)")


def _generation(body: str, summary: str, stream: str = OPENAI_STREAM,
                error_body: str = "ErrorResponse") -> dict:
    """A generation route: a JSON body, or with `stream: true` the events `stream` describes."""
    streamed = {"description": stream,
                "content": {"application/json": {"schema": OBJECT},
                            "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {"200": streamed,
                      **_errors(400, 401, 404, 413, 503, 504, body=error_body)},
    }}


def _responses() -> dict:
    """POST /v1/responses: its stream is typed events, not chat's chunks and `[DONE]`."""
    return _generation(
        "ResponsesRequest", "OpenAI's Responses API (nothing is stored)",
        "OK; with `stream: true` Server-Sent Events, each with an `event:` line and a "
        "`sequence_number`, from `response.created` to `response.completed` or "
        "`response.incomplete` (an error mid-stream is an `error` event)")


def _messages() -> dict:
    """Anthropic's route: its own events and error body."""
    return _generation(
        "MessagesRequest",
        "Anthropic's Messages API, generated as the chat completion it translates to",
        "OK: a message; with `stream: true` Server-Sent Events, each `event: <type>` with its "
        "`data` (message_start ... message_stop; an error mid-stream is `event: error`)",
        error_body="AnthropicErrorResponse")


def _post(body: str, summary: str, answer: str, errors: tuple[int, ...]) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(body)}}},
        "responses": {"200": _json(_ref(answer)), **_errors(*errors)},
    }}


def _get(summary: str, schema: dict | None = None, content_type: str = "application/json",
         errors: tuple[int, ...] = (401,)) -> dict:
    ok = {"description": "OK", "content": {content_type: {"schema": schema or OBJECT}}}
    return {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}


def _schemas() -> dict[str, Any]:
    """The request bodies as msgspec writes them, where they are loose on purpose made exact,
    and the answers'."""
    _, schemas = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, GenerateRequest, TokenizeRequest,
         DetokenizeRequest, ResponsesRequest, MessageItem, FunctionCallItem,
         FunctionCallOutputItem, FunctionTool, MessagesRequest, LoadLoraAdapterRequest,
         UnloadLoraAdapterRequest], ref_template=REF)
    messages = {"type": "array", "minItems": 1, "items": _ref("ChatMessage")}
    schemas["ChatCompletionRequest"]["properties"]["messages"] = messages
    schemas["TokenizeRequest"]["properties"]["messages"] = messages
    schemas["TokenizeRequest"]["oneOf"] = [  # exactly one of them
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": messages}},
    ]
    schemas["CompletionRequest"]["properties"]["prompt"] = PROMPT
    schemas["GenerateRequest"]["oneOf"] = [  # exactly one of them
        {"required": ["text"], "properties": {"text": TEXT}},
        {"required": ["input_ids"], "properties": {"input_ids": TOKEN_IDS}},
    ]
    items = {"anyOf": [_ref("MessageItem"), _ref("FunctionCallItem"),
                       _ref("FunctionCallOutputItem")]}
    responses = schemas["ResponsesRequest"]["properties"]
    responses["input"] = {"anyOf": [{"type": "string"}, {
        "type": "array", "minItems": 1, "maxItems": MAX_INPUT_ITEMS, "items": items}]}
    responses["tools"] = {"anyOf": [{"type": "array", "maxItems": MAX_TOOLS,
                                     "items": _ref("FunctionTool")}, {"type": "null"}]}
    schemas.update(ChatMessage=CHAT_MESSAGE, AbortRequest=ABORT_REQUEST,
                   ErrorResponse=ERROR_RESPONSE, AnthropicErrorResponse=ANTHROPIC_ERROR_RESPONSE,
                   TokenizeResponse=TOKENIZE_RESPONSE,
                   DetokenizeResponse=DETOKENIZE_RESPONSE,
                   LoraAdapterResponse=LORA_ADAPTER_RESPONSE)
    return schemas


def spec(model_name: str, api_key: bool = False) -> dict[str, Any]:
    schemas = _schemas()
    flush = _get("drop the prefix cache (refused while requests run)", errors=(400, 401, 503))
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "tokenline", "version": "0.1.0",
                 "description": f"OpenAI-compatible serving of {model_name}"},
        "paths": {
            "/v1/chat/completions": _generation("ChatCompletionRequest", "chat completion"),
            "/v1/completions": _generation("CompletionRequest", "text completion"),
            "/v1/responses": _responses(),
            "/v1/messages": _messages(),
            "/generate": _generation("GenerateRequest", "SGLang-style native generation"),
            "/tokenize": _post("TokenizeRequest", "vLLM's: the token ids of a prompt, or of "
                               "messages as a chat completion renders them", "TokenizeResponse",
                               (400, 401, 404, 413, 503)),
            "/detokenize": _post("DetokenizeRequest", "vLLM's: token ids back to text",
                                 "DetokenizeResponse", (400, 401, 404, 413)),
            "/v1/models": {"get": _get("the served model")},
            "/health": {"get": {**_get("ready when every stage has a live instance",
                                       errors=(503,)), "security": []}},
            "/get_server_info": {"get": _get("engine facts (KV pool, model, schedulers)")},
            "/metrics": {"get": {**_get("Prometheus metrics", {"type": "string"}, "text/plain",
                                        errors=(404,)), "security": []}},
            "/openapi.json": {"get": {**_get("this document", errors=()), "security": []}},
            "/flush_cache": {"get": flush, "post": flush},
            "/load_lora_adapter": _post("LoadLoraAdapterRequest", "serve a PEFT LoRA adapter as "
                                        "`model` = lora_name (a 400 names what is wrong with "
                                        "it)", "LoraAdapterResponse", (400, 401, 413, 503)),
            "/unload_lora_adapter": _post("UnloadLoraAdapterRequest", "stop serving a LoRA "
                                          "adapter (its running requests finish first)",
                                          "LoraAdapterResponse", (400, 401, 404, 413, 503)),
            "/abort_request": {"post": {
                "summary": "abort a request by id, or all of them",
                "requestBody": {"required": True, "content": {
                    "application/json": {"schema": _ref("AbortRequest")}}},
                "responses": {"200": _json(OBJECT), **_errors(400, 401)},
            }},
        },
        "components": {"schemas": schemas},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
