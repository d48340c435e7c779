"""The Messages API's reply, in Anthropic's shapes: a `message` body, or its SSE events.

Streamed, every event is `event: <type>` + `data: {"type": <type>, ...}`, in Anthropic's order:

    message_start                      the message with no content, input usage
    content_block_start  (index i)     a text block, or a tool_use block with its id and name
    content_block_delta  (index i)...  text_delta pieces, or input_json_delta pieces
    content_block_stop   (index i)     then the next block, i + 1
    message_delta                      stop_reason, stop_sequence, the usage at the end
    message_stop

An error after the first event is an `event: error` with Anthropic's error body.
"""

from __future__ import annotations

import json

import msgspec

from common.messages import Finish, TextOut
from common.tool_calls import CallDelta, ToolCall
from services.gateway.anthropic import ID_PREFIX, error_body
from services.gateway.protocol import APIError, ChatCompletionRequest
from services.gateway.render import Decode, Renderer
from services.gateway.tracker import SubRequest


def stop_reason(finish: Finish | None, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished reply."""
    if finish is None:
        return None, None
    if finish.kind == "length":
        return "max_tokens", None
    if isinstance(finish.matched, str):  # a stop string; an int is EOS or a stop token
        return "stop_sequence", finish.matched
    return ("tool_use" if called else "end_turn"), None


def usage(sub: SubRequest) -> dict:
    """Anthropic counts cached prompt tokens apart: input + cache_read is the whole prompt."""
    return {"input_tokens": sub.prompt_tokens - sub.cached_tokens,
            "cache_read_input_tokens": sub.cached_tokens,
            "output_tokens": len(sub.token_ids)}


def tool_use_id(call_id: str) -> str:
    return ID_PREFIX + call_id.removeprefix("call_")


def tool_use(call: ToolCall) -> dict:
    """A call as a tool_use block; arguments cut short (max_tokens) are an empty input."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
            "input": args if isinstance(args, dict) else {}}


def _event(data: dict) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


class MessagesRenderer(Renderer):
    def __init__(self, rid: str, model: str, decode: Decode, req: ChatCompletionRequest) -> None:
        super().__init__(rid, model, decode)
        _, self.plan, _ = req.tool_plan()
        self.parser = self.plan.parser() if self.plan else None
        self.started = False
        self.index = -1  # of the block open (or last closed)
        self.open: str | None = None  # its type, while open
        self.called = False  # a tool_use block was sent

    def message(self, content: list, sub: SubRequest, reason: str | None,
                sequence: str | None) -> dict:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(sub)}

    def final(self, subs: list[SubRequest]) -> dict:
        sub = subs[0]
        content, calls = sub.text, []
        if self.plan is not None:
            p = self.plan.parser()
            content = p.feed(sub.text).content + p.finish().content
            calls = p.calls if self.plan.parallel else p.calls[:1]
            content = content.strip() if calls else content
        blocks = [{"type": "text", "text": content}] if content else []
        blocks += [tool_use(c) for c in calls]
        return self.message(blocks, sub, *stop_reason(sub.finish, bool(calls)))

    # -- streamed -------------------------------------------------------------------------------
    def sse(self, chunk: dict | list) -> bytes:
        return b"".join(_event(e) for e in (chunk if isinstance(chunk, list) else [chunk]))

    def error_event(self, exc: APIError) -> bytes:
        return _event(error_body(exc))

    def done(self) -> bytes:
        return b""  # message_stop ended it

    def chunk(self, sub: SubRequest, out: TextOut) -> list[dict] | None:
        events: list[dict] = []
        if not self.started:
            self.started = True
            events.append({"type": "message_start", "message": self.message(
                [], sub, None, None) | {"usage": {**usage(sub), "output_tokens": 0}}})
        content, calls = out.text, []
        if self.parser is not None:
            piece = self.parser.feed(out.text)
            content, calls = piece.content, piece.calls
            if out.finish is not None:
                content += self.parser.finish().content
        if content:
            self._open("text", {"type": "text", "text": ""}, events)
            events.append(self._delta({"type": "text_delta", "text": content}))
        for call in calls:
            self._call(call, events)
        return events or None

    def _call(self, call: CallDelta, events: list[dict]) -> None:
        if self.plan is not None and not self.plan.parallel and call.index > 0:
            return
        if call.id is not None:
            self.called = True
            self._open(None, {"type": "tool_use", "id": tool_use_id(call.id),
                              "name": call.name, "input": {}}, events)
        if call.arguments:
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": call.arguments}))

    def _open(self, kind: str | None, block: dict, events: list[dict]) -> None:
        """Start `block` unless a block of `kind` is open (None: always a new one)."""
        if kind is not None and self.open == kind:
            return
        self._close(events)
        self.index += 1
        self.open = block["type"]
        events.append({"type": "content_block_start", "index": self.index,
                       "content_block": block})

    def _close(self, events: list[dict]) -> None:
        if self.open is not None:
            events.append({"type": "content_block_stop", "index": self.index})
            self.open = None

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def tail(self, subs: list[SubRequest]) -> list[list[dict]]:
        sub = subs[0]
        events: list[dict] = []
        self._close(events)
        reason, sequence = stop_reason(sub.finish, self.called)
        events += [{"type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage(sub)},
                   {"type": "message_stop"}]
        return [events]
