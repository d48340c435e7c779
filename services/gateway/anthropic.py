"""Anthropic's Messages API (`POST /v1/messages`): its request body, checked as Anthropic checks
it, translated onto the chat completion the route's reply is generated from.

The translation is the whole route: `system` and the turns become chat messages (a tool_use
block an assistant's `tool_calls`, a tool_result block a `tool` message), `tools` and
`tool_choice` the chat request's, so the prompt goes through the same chat template and the
reply through the same tool-call grammar and parser (constraints.py). Only the shapes differ;
`anthropic_render.py` writes the reply in Anthropic's.

Refused with a 400 naming the field (Anthropic's own fields we do not implement): any field
or block type not below (`thinking`, `container`, `mcp_servers`, image and document blocks,
server tools, citations, ...), `service_tier` other than auto / standard_only, a final
assistant turn (prefill).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from services.gateway.constraints import (
    FunctionChoice,
    FunctionDef,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolChoice,
)
from services.gateway.protocol import APIError, ChatCompletionRequest, Positive, TopP

PATH = "/v1/messages"
MAX_MESSAGES = 100_000  # Anthropic's limit; --max-request-bytes bounds the body before it
ID_PREFIX = "toolu_"  # a tool_use id, Anthropic's way; the parser's calls are "call_..."

# Anthropic's error types by HTTP status (https://docs.claude.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
# a field of the chat request an error names, as this route's body calls it
_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def error_body(exc: APIError) -> dict:
    """Anthropic's error body: the message names the field (it has no `param`)."""
    param = exc.param
    if param is not None:
        param = _PARAMS.get(param, param).replace(".function.parameters", ".input_schema")
    message = exc.message
    if param and param not in message:
        message = f"{param}: {message}"
    err_type = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500
                               else "invalid_request_error")
    return {"type": "error", "error": {"type": err_type, "message": message}}


class CacheControl(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A prompt-caching breakpoint: changes nothing here, where every prompt's full blocks are
    cached by their prefix anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class _Block(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    cache_control: CacheControl | None = None


class TextBlock(_Block, tag="text"):
    text: str
    citations: None = None  # citing documents is not implemented


class ToolUseBlock(_Block, tag="tool_use"):
    id: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]+$")]
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block, tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False  # the tool failed: its text goes to the model after "Error: "


Block = TextBlock | ToolUseBlock | ToolResultBlock


class _Turn(msgspec.Struct, tag_field="role", kw_only=True, forbid_unknown_fields=True):
    content: str | list[Block]


class UserMessage(_Turn, tag="user"):
    pass


class AssistantMessage(_Turn, tag="assistant"):
    pass


class SystemMessage(msgspec.Struct, tag_field="role", tag="system", kw_only=True,
                    forbid_unknown_fields=True):
    content: str | list[TextBlock]


MessageParam = UserMessage | AssistantMessage | SystemMessage


class AnthropicTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A client tool (Anthropic's server tools, e.g. web search, are not implemented)."""

    name: FunctionName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None


class _Choice(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    pass


class ToolChoiceAuto(_Choice, tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(_Choice, tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(_Choice, tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(_Choice, tag="none"):
    pass


AnthropicToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class MessagesMetadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    user_id: Annotated[str, Meta(max_length=256)] | None = None  # kept by nobody here


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: Positive
    messages: Annotated[list[MessageParam], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: TopP | None = None
    top_k: Positive | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: MessagesMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion this request is: same prompt, sampling and tool plan."""
        tools, choice, parallel = self._tools()
        return ChatCompletionRequest(
            model=self.model, messages=chat_messages(self.system, self.messages),
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, stop=self.stop_sequences, stream=self.stream, tools=tools,
            tool_choice=choice, parallel_tool_calls=parallel,
            user=self.metadata.user_id if self.metadata else None)

    def _tools(self) -> tuple[list[Tool] | None, ToolChoice | None, bool]:
        for i, t in enumerate(self.tools or []):
            _check(t.input_schema.get("type") == "object",
                   "input_schema must be a JSON schema of type object", f"tools[{i}].input_schema")
        tools = [Tool(type="function", function=FunctionDef(
            name=t.name, description=t.description, parameters=t.input_schema, strict=t.strict))
            for t in self.tools] if self.tools else None
        c = self.tool_choice
        parallel = not getattr(c, "disable_parallel_tool_use", False)
        if c is None or isinstance(c, ToolChoiceAuto):
            return tools, None if c is None else "auto", parallel
        if isinstance(c, ToolChoiceNone):
            return tools, "none", parallel
        if isinstance(c, ToolChoiceAny):
            return tools, "required", parallel
        return tools, NamedToolChoice(type="function", function=FunctionChoice(c.name)), parallel


# -- the conversation ---------------------------------------------------------------------------
def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise APIError(message, param)


def _blocks(content: str | list) -> list:
    return [TextBlock(text=content)] if isinstance(content, str) else list(content)


def _text(blocks: list[TextBlock]) -> str:
    return "".join(b.text for b in blocks)


def _turns(messages: list[MessageParam]) -> list[tuple[int, str, list]]:
    """(index of its first message, role, blocks): consecutive user or assistant messages are
    one turn, as Anthropic combines them."""
    turns: list[tuple[int, str, list]] = []
    for i, m in enumerate(messages):
        role = {UserMessage: "user", AssistantMessage: "assistant"}.get(type(m), "system")
        blocks = _blocks(m.content)
        _check(bool(blocks), "all messages must have non-empty content", f"messages[{i}]")
        for j, b in enumerate(blocks):
            _check(not isinstance(b, TextBlock) or role == "system" or bool(b.text.strip()),
                   "text content blocks must contain non-whitespace text",
                   f"messages[{i}].content[{j}]")
        if turns and role != "system" and turns[-1][1] == role:
            turns[-1][2].extend(blocks)
        else:
            turns.append((i, role, blocks))
    return turns


def _check_turns(turns: list[tuple[int, str, list]]) -> None:
    """Anthropic's pairing: every tool_use answered by a tool_result in the next turn, every
    tool_result answering a tool_use of the turn before; no prefill."""
    i, role, _ = turns[-1]
    _check(role != "assistant", "the final message is the assistant's: continuing it (prefill) "
           "is not supported", f"messages[{i}]")
    seen: set[str] = set()
    asked: list[str] = []
    for i, role, blocks in turns:
        uses = [b.id for b in blocks if isinstance(b, ToolUseBlock)]
        results = [b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)]
        wrong = ToolResultBlock if role == "assistant" else ToolUseBlock
        _check(not any(isinstance(b, wrong) for b in blocks),
               f"{wrong.__struct_config__.tag} blocks are not allowed in {role} messages",
               f"messages[{i}].content")
        unknown = [r for r in results if r not in asked]
        _check(not unknown, f"unexpected tool_use_id found in tool_result blocks: "
               f"{', '.join(unknown)}. Each tool_result block must have a corresponding "
               "tool_use block in the previous message", f"messages[{i}].content")
        missing = [a for a in asked if a not in results]
        _check(not missing, f"tool_use ids were found without tool_result blocks immediately "
               f"after: {', '.join(missing)}. Each tool_use block must have a corresponding "
               "tool_result block in the next message", f"messages[{i}]")
        dup = [u for u in uses if u in seen or uses.count(u) > 1]
        _check(not dup, f"tool_use ids must be unique: {dup[0] if dup else ''}",
               f"messages[{i}].content")
        seen.update(uses)
        asked = uses


def _chat_turn(role: str, blocks: list) -> list[dict]:
    """One turn as chat messages: an assistant's text and calls one message; a user's text and
    tool results in their order, each result a `tool` message."""
    if role == "assistant":
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        text = [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]
        return [{"role": "assistant", "content": text or None,
                 **({"tool_calls": calls} if calls else {})}]
    out: list[dict] = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            text = b.content if isinstance(b.content, str) else _text(b.content)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": f"Error: {text}" if b.is_error else text})
        elif out and out[-1]["role"] == role:
            out[-1]["content"].append({"type": "text", "text": b.text})
        else:
            out.append({"role": role, "content": [{"type": "text", "text": b.text}]})
    return out


def chat_messages(system: str | list[TextBlock] | None,
                  messages: list[MessageParam]) -> list[dict]:
    """`system` and the turns as the chat messages a chat completion is rendered from."""
    turns = _turns(messages)
    _check_turns(turns)
    out: list[dict] = []
    if system is not None:
        out.append({"role": "system", "content": system if isinstance(system, str)
                    else _text(system)})
    for _, role, blocks in turns:
        out += _chat_turn(role, blocks)
    return out
