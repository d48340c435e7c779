"""The Responses API's bodies: the `response` object, and the typed events of a streamed one.

A streamed response, event by event (each with the next `sequence_number`):

    response.created, response.in_progress                 (with the first output)
    response.output_item.added   message                   text, once it is more than blanks
      response.content_part.added, response.output_text.delta ..., response.output_text.done,
      response.content_part.done, response.output_item.done
    response.output_item.added   function_call             per call the parser reads
      response.function_call_arguments.delta ..., response.function_call_arguments.done,
      response.output_item.done
    response.completed | response.incomplete               the whole response, with usage

The items streamed are the items of the final response (same ids), built by one `Output`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from common.messages import TextOut
from common.tool_calls import CallDelta
from services.gateway import constraints
from services.gateway.constraints import ToolPlan
from services.gateway.protocol import APIError
from services.gateway.render import usage
from services.gateway.responses import FunctionToolChoice, ResponsesRequest, responses_param
from services.gateway.tracker import SubRequest

Event = tuple[str, dict]  # (type, data without type and sequence_number)


def frames(events: list[dict]) -> bytes:
    """SSE frames, each with its `event:` line."""
    return b"".join(b"event: " + e["type"].encode() + b"\ndata: " + msgspec.json.encode(e)
                    + b"\n\n" for e in events)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def responses_usage(subs: list[SubRequest]) -> dict:
    u = usage(subs)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def _no_nones(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _message(text: str, status: str) -> dict:
    return {"type": "message", "id": new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": new_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesRenderer:
    """One response's bodies: `final` unstreamed, `events` and `end` streamed. The gateway's
    stream driver (server._stream) sees it as any renderer: a chunk is the list of events one
    output makes, framed by `sse`; the tail is the closing events; no `[DONE]`."""

    def __init__(self, rid: str, model: str, req: ResponsesRequest) -> None:
        self.rid = rid
        self.model = model
        self.req = req
        self.created = int(time.time())
        _, self.plan, _ = req.plan()
        self.seq = 0
        self.output: Output | None = None  # streaming only

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        """The `response` object, with the request's settings echoed as OpenAI echoes them."""
        req = self.req
        choice: Any = req.tool_choice or "auto"
        if isinstance(choice, FunctionToolChoice):
            choice = {"type": "function", "name": choice.name}
        fmt = req.text.format if req.text is not None else None
        incomplete = status == "incomplete"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning else None,
            "store": False, "background": False, "service_tier": req.service_tier or "default",
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": _no_nones(msgspec.to_builtins(fmt)) if fmt else {"type": "text"}},
            "tool_choice": choice, "tools": [t | {"strict": t.get("strict"), "parameters":
                                               t.get("parameters")} for t in req.tools or []],
            "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": dict(req.metadata or {}),
        }

    def final(self, subs: list[SubRequest]) -> dict:
        sub = subs[0]
        status = "incomplete" if sub.finish_reason == "length" else "completed"
        message, _ = constraints.message(sub.text, self.plan, sub.finish_reason)
        calls = message.get("tool_calls") or []
        output = [_message(message["content"] or "", status)] if message["content"] or \
            not calls else []
        output += [_call(c["id"], c["function"]["name"], c["function"]["arguments"], status)
                   for c in calls]
        return self.response(status, output, responses_usage(subs))

    # -- streaming -------------------------------------------------------------------------------
    def event(self, kind: str, data: dict) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **data}

    def events(self, sub: SubRequest, out: TextOut) -> list[dict]:
        """The events one output makes (the first one opens the response)."""
        evs = self.opening()
        assert self.output is not None
        evs += self.output.feed(out.text)
        return [self.event(kind, data) for kind, data in evs]

    def opening(self) -> list[Event]:
        if self.output is not None:
            return []
        self.output = Output(self.plan)
        opened = self.response("in_progress", [], None)
        return [("response.created", {"response": opened}),
                ("response.in_progress", {"response": opened})]

    def end(self, subs: list[SubRequest]) -> list[dict]:
        """What closes the stream: the open items done, then the whole response."""
        evs = self.opening()
        sub = subs[0]
        status = "incomplete" if sub.finish_reason == "length" else "completed"
        assert self.output is not None
        evs += self.output.finish(status)
        body = self.response(status, self.output.items, responses_usage(subs))
        evs.append((f"response.{status}", {"response": body}))
        return [self.event(kind, data) for kind, data in evs]


    # -- as the gateway's Renderer (render.py) ---------------------------------------------------
    def chunk(self, sub: SubRequest, out: TextOut) -> list[dict] | None:
        return self.events(sub, out) or None

    def with_usage(self, chunk: list[dict], subs: list[SubRequest]) -> list[dict]:
        return chunk

    def tail(self, subs: list[SubRequest]) -> list[list[dict]]:
        return [self.end(subs)]

    def sse(self, events: list[dict]) -> bytes:
        return frames(events)

    def error_event(self, exc: APIError) -> bytes:
        return frames([self.event("error", {"code": exc.code or exc.err_type,
                                            "message": exc.message,
                                            "param": responses_param(exc.param)})])

    def done(self) -> bytes:
        return b""

class Output:
    """A streamed reply read into output items, and the events that build them."""

    def __init__(self, plan: ToolPlan | None) -> None:
        self.plan = plan
        self.parser = plan.parser() if plan is not None else None
        self.items: list[dict] = []
        self.text_item: int | None = None  # the open message item's output_index
        self.blank = ""  # blanks not yet shown: none opens a message item by itself
        self.calls: dict[int, int] = {}  # the parser's call index -> output_index

    def feed(self, text: str) -> list[Event]:
        if self.parser is None:
            return self.text(text)
        piece = self.parser.feed(text)
        evs = self.text(piece.content)
        for d in piece.calls:
            evs += self.call(d)
        return evs

    def text(self, text: str) -> list[Event]:
        if self.text_item is None:
            text = self.blank + text
            if not text.strip():
                self.blank = text
                return []
            self.blank = ""
        evs = [] if self.text_item is not None else self.open_text()
        item = self.items[self.text_item]
        item["content"][0]["text"] += text
        return [*evs, ("response.output_text.delta", {
            "item_id": item["id"], "output_index": self.text_item, "content_index": 0,
            "delta": text, "logprobs": []})]

    def open_text(self) -> list[Event]:
        self.text_item = len(self.items)
        item = _message("", "in_progress")
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": []}
        added = {**item, "content": []}
        return [("response.output_item.added", {"output_index": self.text_item, "item": added}),
                ("response.content_part.added", {"item_id": item["id"], "output_index":
                                                 self.text_item, "content_index": 0,
                                                 "part": part})]

    def call(self, d: CallDelta) -> list[Event]:
        assert self.plan is not None
        if not self.plan.parallel and d.index > 0:
            return []
        evs: list[Event] = []
        if d.id is not None:
            evs += self.close_text("completed")
            self.calls[d.index] = len(self.items)
            item = _call(d.id, d.name or "", "", "in_progress")
            self.items.append(item)
            evs.append(("response.output_item.added", {"output_index": self.calls[d.index],
                                                       "item": dict(item)}))
        at = self.calls[d.index]
        if d.arguments:
            self.items[at]["arguments"] += d.arguments
            evs.append(("response.function_call_arguments.delta", {
                "item_id": self.items[at]["id"], "output_index": at, "delta": d.arguments}))
        return evs

    def close_text(self, status: str) -> list[Event]:
        if self.text_item is None:
            return []
        at, self.text_item = self.text_item, None
        item = self.items[at]
        item["status"] = status
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return [("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
                ("response.content_part.done", {**where, "part": part}),
                ("response.output_item.done", {"output_index": at, "item": item})]

    def finish(self, status: str) -> list[Event]:
        evs = self.text(self.parser.finish().content) if self.parser is not None else []
        if not self.items:  # a reply of nothing (or blanks) is still a message
            evs += self.open_text()
            if self.blank:
                evs += self.text(self.blank)
        evs += self.close_text(status)
        for index, at in self.calls.items():
            item = self.items[at]
            if self.parser is not None and index < len(self.parser.calls):
                item["arguments"] = self.parser.calls[index].arguments
            item["status"] = status
            evs += [("response.function_call_arguments.done", {
                        "item_id": item["id"], "output_index": at,
                        "arguments": item["arguments"]}),
                    ("response.output_item.done", {"output_index": at, "item": item})]
        return evs
