"""Structured outputs and tool calls at the HTTP edge: the request fields, their checks, and
how a reply's text becomes `message.tool_calls`.

Where a constraint can come from (at most one per request; two is a 400 naming both):

    OpenAI chat, completions   response_format {"type": "json_object" | "json_schema", ...}
    vLLM (extra_body)          structured_outputs {"json" | "regex" | "choice" | "grammar" |
                               "json_object"}
    SGLang /generate           sampling_params.json_schema | regex | ebnf
    chat tool_choice           "required" or a named function: a JSON-schema grammar over the
                               allowed calls, so even a small model returns a valid call

The scheduler compiles the constraint; one that does not compile comes back as a 400 naming
the field recorded in `StructuredOutputs.param`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from common import tool_calls
from common.messages import StructuredOutputs
from common.tool_calls import CallDelta, ToolCallParser

FunctionName = Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_.-]{1,64}$",
                                   description="letters, digits, _ . -; at most 64")]


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (set at most one)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionChoice(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionChoice


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class APIFieldError(ValueError):
    """A bad constraint or tool field; the gateway answers it with a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def sendable(value: Any, param: str) -> None:
    """A 400 naming `param` for free-form JSON the services' msgpack cannot carry (an
    integer beyond 64 bits in a schema), rather than a 500 when the gateway sends it on."""
    try:
        msgspec.msgpack.encode(value)
    except (OverflowError, TypeError) as exc:
        raise APIFieldError(f"`{param}` cannot be sent on: {exc}", param) from None


def _one(found: list[tuple[str, StructuredOutputs]]) -> StructuredOutputs | None:
    if len(found) > 1:
        names = [p for p, _ in found]
        raise APIFieldError(f"{' and '.join(names)}: give at most one output constraint",
                            names[0])
    if not found:
        return None
    name, constraint = found[0]
    sendable(constraint, constraint.param or name)
    return constraint


def _from_response_format(rf: ResponseFormat | None) -> list[tuple[str, StructuredOutputs]]:
    if rf is None or rf.type == "text":
        return []
    if rf.type == "json_object":
        return [("response_format", StructuredOutputs(json_object=True,
                                                       param="response_format"))]
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise APIFieldError("response_format of type json_schema needs json_schema.schema",
                            "response_format.json_schema")
    return [("response_format", StructuredOutputs(json=rf.json_schema.schema,
                                                   param="response_format.json_schema.schema"))]


def _from_structured_outputs(so: StructuredOutputsField | None,
                             prefix: str = "structured_outputs"
                             ) -> list[tuple[str, StructuredOutputs]]:
    if so is None:
        return []
    found = []
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(so, name)
        if value is not None:
            param = f"{prefix}.{name}"
            found.append((param, StructuredOutputs(**{name: value}, param=param)))
    if so.json_object:
        param = f"{prefix}.json_object"
        found.append((param, StructuredOutputs(json_object=True, param=param)))
    return found


def completion_constraint(response_format: ResponseFormat | None,
                          structured_outputs: StructuredOutputsField | None
                          ) -> StructuredOutputs | None:
    return _one(_from_response_format(response_format)
                + _from_structured_outputs(structured_outputs))


def generate_constraint(json_schema: str | dict | None, regex: str | None,
                        ebnf: str | None) -> StructuredOutputs | None:
    """SGLang's sampling_params.json_schema / regex / ebnf."""
    found = []
    if json_schema is not None:
        found.append(("sampling_params.json_schema",
                      StructuredOutputs(json=json_schema, param="sampling_params.json_schema")))
    if regex is not None:
        found.append(("sampling_params.regex",
                      StructuredOutputs(regex=regex, param="sampling_params.regex")))
    if ebnf is not None:
        found.append(("sampling_params.ebnf",
                      StructuredOutputs(grammar=ebnf, param="sampling_params.ebnf")))
    return _one(found)


@dataclass
class ToolPlan:
    """What a chat request asks of tools: `auto` parses calls the model chose to write;
    `required` and `named` constrain the reply to calls, then read them."""

    mode: Literal["auto", "required", "named"]
    parallel: bool
    name: str | None = None  # named

    def parser(self) -> ToolCallParser:
        return ToolCallParser(tagged=self.mode == "auto", name=self.name)


def chat_plan(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel: bool,
              response_format: ResponseFormat | None,
              structured_outputs: StructuredOutputsField | None
              ) -> tuple[StructuredOutputs | None, ToolPlan | None, list[dict] | None]:
    """(the constraint, the tool plan, the tools as dicts for the prompt) of a chat request."""
    found = _from_response_format(response_format) + _from_structured_outputs(structured_outputs)
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIFieldError("tool_choice needs tools", "tool_choice")
        return _one(found), None, None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIFieldError("tools: two functions share one name", "tools")
    as_dicts = [msgspec.to_builtins(t) for t in tools]
    for i, t in enumerate(as_dicts):
        sendable(t, f"tools[{i}]")
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return _one(found), None, as_dicts
    if choice == "auto":
        return _one(found), ToolPlan("auto", parallel), as_dicts
    if choice == "required":
        schema = tool_calls.required_schema(as_dicts, parallel)
        found.append(("tool_choice", StructuredOutputs(json=json.dumps(schema),
                                                       param="tools")))
        return _one(found), ToolPlan("required", parallel), as_dicts
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in names:
        raise APIFieldError(f"tool_choice names the function {name!r}, which is not among "
                            f"tools ({', '.join(names)})", "tool_choice")
    params = tools[names.index(name)].function.parameters or {"type": "object"}
    found.append(("tool_choice", StructuredOutputs(json=params,
                                                   param=f"tools[{names.index(name)}]"
                                                         ".function.parameters")))
    return _one(found), ToolPlan("named", parallel, name), as_dicts


def message(text: str, plan: ToolPlan | None, finish_reason: str | None
            ) -> tuple[dict, str | None]:
    """A whole reply as an assistant message, and its finish reason (`tool_calls` when the
    reply is calls and ended by itself)."""
    if plan is None:
        return {"role": "assistant", "content": text}, finish_reason
    p = plan.parser()
    content = p.feed(text).content + p.finish().content
    calls = p.calls if plan.parallel else p.calls[:1]
    if not calls:
        return {"role": "assistant", "content": content}, finish_reason
    msg = {"role": "assistant", "content": content.strip() or None,
           "tool_calls": [c.openai() for c in calls]}
    return msg, "tool_calls" if finish_reason == "stop" else finish_reason


def call_deltas(deltas: list[CallDelta], parallel: bool) -> list[dict]:
    """Streamed calls, OpenAI's shape: the first delta of a call has index, id, type and name,
    later ones pieces of `arguments`."""
    out = []
    for d in deltas:
        if not parallel and d.index > 0:
            continue
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


class ChatToolStream:
    """A streamed chat reply's choices, each read through its own tool-call parser."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parsers: dict[int, ToolCallParser] = {}

    def delta(self, index: int, text: str, finished: bool, delta: dict,
              reason: str | None) -> str | None:
        """Put the content and call pieces of `text` into `delta`; returns the finish reason
        (`tool_calls` for a reply of calls that ended by itself)."""
        parser = self.parsers.setdefault(index, self.plan.parser())
        piece = parser.feed(text)
        content = piece.content
        if finished:
            content += parser.finish().content
            if parser.calls and reason == "stop":
                reason = "tool_calls"
        if content:
            delta["content"] = content
        if calls := call_deltas(piece.calls, self.plan.parallel):
            delta["tool_calls"] = calls
        return reason
