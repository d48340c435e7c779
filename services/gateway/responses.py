"""OpenAI's Responses API (`POST /v1/responses`): the body, its checks, and its translation
onto what a chat completion already is.

    instructions                      a first system message
    input "text"                      one user message
    {"type": "message", role, ...}    a chat message of that role (text parts joined)
    {"type": "function_call", ...}    the assistant's `tool_calls` (consecutive calls: one message)
    {"type": "function_call_output"}  a `tool` message answering that call_id
    tools [{"type": "function", name, parameters, ...}]   chat's nested `function` tools
    tool_choice {"type": "function", "name"}              chat's named tool_choice
    text.format                                           chat's response_format

So the prompt, the tool-call grammar and parser, and the structured-output constraint are the
chat route's own (`constraints.chat_plan`). Nothing is kept: `store: true` and
`previous_response_id` are a 400 naming the field, as is every field not declared here.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from common.messages import SamplingParams, StructuredOutputs
from services.gateway.constraints import (
    FunctionChoice,
    FunctionDef,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolPlan,
    chat_plan,
)
from services.gateway.protocol import (
    REASONING_MARKS,
    APIError,
    Int,
    Metadata,
    Positive,
    ReasoningEffort,
    ServiceTier,
    Temperature,
    TopP,
    check_messages,
)

MAX_INPUT_ITEMS = 2048  # far more turns than a context holds; a huge list is a 400, not work
MAX_TOOLS = 128  # OpenAI's limit on function tools
ROLES = ("user", "assistant", "system", "developer")
ITEM_TYPES = ("message", "function_call", "function_call_output")


class ContentPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Text in a message item; `output_text` is what an earlier response gave back (its
    annotations and logprobs come along when a client passes `response.output` on)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: Annotated[str, Meta(min_length=1)]
    name: FunctionName
    arguments: str  # JSON text, as the response gave it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class OutputText(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["input_text"]
    text: str


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[OutputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEM_STRUCTS: dict[str, type] = dict(zip(ITEM_TYPES, (MessageItem, FunctionCallItem,
                                                      FunctionCallOutputItem), strict=True))


class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A Responses function tool: flat, not nested under `function` as in chat."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None


class Reasoning(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


InputList = Annotated[list[Any], Meta(max_length=MAX_INPUT_ITEMS, description=(
    f"message, function_call and function_call_output items (at most {MAX_INPUT_ITEMS})"))]


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | InputList
    instructions: str | None = None
    tools: Annotated[list[Any], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True  # false: at most one call, as on the chat route
    text: TextConfig | None = None
    max_output_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Int | None = None  # not OpenAI's here, but vLLM's and the chat route's
    stream: bool = False
    # what keeps a response: refused unless off (this server keeps none)
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # OpenAI's that change nothing here
    user: str | None = None
    metadata: Metadata | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: Reasoning | None = None
    # extra output to include: none is produced here, so only an empty list (the Agents SDK
    # sends one) is accepted
    include: Annotated[list[str], Meta(max_length=16)] | None = None

    def check_unused(self, chat_template: str | None) -> None:
        _check(not self.store, "store: true is not supported: this server keeps no responses",
               "store")
        _check(self.previous_response_id is None, "previous_response_id is not supported: "
               "this server keeps no responses; send the whole conversation as `input`",
               "previous_response_id")
        _check(not self.background, "background: true is not supported: a response is "
               "served on this request's connection", "background")
        _check(not self.include, f"include: {self.include[0] if self.include else ''} is not "
               "supported: this server adds nothing to a response", "include")
        reasons = any(mark in (chat_template or "") for mark in REASONING_MARKS)
        _check(self.reasoning is None or not reasons, "reasoning is not supported: this "
               "model's chat template reasons, and its settings are not passed on", "reasoning")

    def plan(self) -> tuple[StructuredOutputs | None, ToolPlan | None, list[dict] | None]:
        """Chat's plan (constraint, tool plan, tools for the prompt), errors named as here."""
        try:
            constraint, plan, tools = chat_plan(self.chat_tools(), self.chat_tool_choice(),
                                                self.parallel_tool_calls,
                                                self.response_format(), None)
        except ValueError as exc:  # constraints.APIFieldError
            raise APIError(str(exc), responses_param(getattr(exc, "param", None))) from None
        if constraint is not None:
            constraint.param = responses_param(constraint.param)
        return constraint, plan, tools

    def chat_tools(self) -> list[Tool] | None:
        if self.tools is None:
            return None
        return [_chat_tool(t, i) for i, t in enumerate(self.tools)]

    def chat_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            return NamedToolChoice(type="function", function=FunctionChoice(choice.name))
        return choice

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type != "json_schema":
            for name in ("name", "schema", "strict", "description"):
                _check(fmt is None or getattr(fmt, name) is None,
                       f"text.format.{name} applies to type json_schema only",
                       f"text.format.{name}")
            return None if fmt is None else ResponseFormat(type=fmt.type)
        _check(fmt.name is not None, "text.format of type json_schema needs a name",
               "text.format.name")
        _check(fmt.schema is not None, "text.format of type json_schema needs a schema",
               "text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict))

    def prompt(self) -> dict:
        """The chat prompt the tokenizer renders: messages and the tools for the template."""
        messages = to_messages(self.instructions, self.input)
        check_messages(messages)
        _, _, tools = self.plan()
        return {"messages": messages, "add_generation_prompt": True, "tools": tools}

    def to_params(self) -> SamplingParams:
        constraint, _, _ = self.plan()
        return SamplingParams(
            max_new_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed, structured_outputs=constraint)


def _chat_tool(raw: Any, i: int) -> Tool:
    param = f"tools[{i}]"
    kind = raw.get("type") if isinstance(raw, dict) else None
    _check(kind == "function", f"{param}: only function tools are supported here, not "
           f"{kind!r} (no built-in tools run on this server)", f"{param}.type")
    t = _convert(raw, FunctionTool, param)
    return Tool(type="function", function=FunctionDef(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))


def to_messages(instructions: str | None, input: str | list[Any]) -> list[dict]:
    """The chat messages of a Responses conversation."""
    messages: list[dict] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        return [*messages, {"role": "user", "content": input}]
    _check(bool(input), "input must not be empty", "input")
    calls: set[str] = set()
    for i, raw in enumerate(input):
        item = _item(raw, i)
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn: its text, calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        else:
            _check(item.call_id in calls, f"input[{i}]: no function_call before it has "
                   f"call_id {item.call_id!r}", f"input[{i}].call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": _text(item.output)})
    return messages


def _item(raw: Any, i: int) -> InputItem:
    param = f"input[{i}]"
    _check(isinstance(raw, dict), f"{param} must be an object", param)
    kind = raw.get("type", "message" if "role" in raw else None)
    _check(kind in ITEM_TYPES, f"{param}: item type {kind!r} is not supported (only "
           f"{', '.join(ITEM_TYPES)})", f"{param}.type")
    return _convert(raw, ITEM_STRUCTS[kind], param)


def _text(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


_PATH = re.compile(r" - at `\$([^`]*)`")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`")


def _convert(raw: Any, kind: type, param: str) -> Any:
    """`raw` as a `kind`, an error naming the field under `param`."""
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        m = _PATH.search(text)
        where = param + (m.group(1) if m else "")
        if u := _UNKNOWN.match(text):
            where = f"{where}.{u.group(1)}"
            raise APIError(f"unknown field `{where}`: this server does not implement it",
                           where) from None
        raise APIError(f"invalid `{where}`: {_PATH.sub('', text)}", where) from None


def responses_param(param: str | None) -> str | None:
    """A chat field's name, as the field that set it is named in a Responses body."""
    if param is None:
        return None
    if param.startswith("response_format"):
        return "text.format.schema" if "schema" in param else "text.format"
    if param.startswith("messages"):
        return "input"
    if param == "max_tokens":
        return "max_output_tokens"
    return param.replace(".function.parameters", ".parameters")


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise APIError(message, param)
