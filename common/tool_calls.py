"""Tool calls: how a model is told about tools, and how its calls are read back from its text.

Two formats, chosen with `--tool-call-parser` (the tokenizer renders the prompt, the gateway
parses the output, so both live here):

    xlam    SmolLM2, xLAM:   <tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>
    hermes  Hermes, Qwen:    <tool_call>{"name": "f", "arguments": {...}}</tool_call>, per call

A model whose chat template knows `tools` gets them through its template; one that does not
(SmolLM2's GGUF template) gets the format's system prompt below, and the assistant's earlier
calls written in the format.

`ToolCallParser` reads a reply as it streams: text outside the tags is content, a partial
`<tool_call>` tag is held back (never shown as content), and inside a tag each call's name is
announced as soon as it is complete and its arguments follow piece by piece, as the model
writes them. Fed the whole text at once it gives the same calls, so a streamed reply joins to
the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"

XLAM_PROMPT = """You are an expert in composing functions. You are given a question and a set \
of possible functions.
Based on the question, you will need to make one or more function/tool calls to achieve the \
purpose.
If none of the functions can be used, point it out and refuse to answer.
If the given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no \
function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""

HERMES_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _arguments_object(arguments: object) -> object:
    """An OpenAI history call's `arguments` (a JSON string) as the object the model wrote."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def system_prompt(fmt: str, tools: list[dict]) -> str:
    if fmt == "hermes":
        return HERMES_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    return XLAM_PROMPT.format(tools=json.dumps([t.get("function", t) for t in tools]))


def render_calls(fmt: str, calls: list[dict]) -> str:
    """An assistant message's OpenAI `tool_calls` as the model would have written them."""
    objs = [{"name": c["function"]["name"],
             "arguments": _arguments_object(c["function"].get("arguments", "{}"))}
            for c in calls]
    if fmt == "hermes":
        return "\n".join(f"{OPEN}\n{json.dumps(o)}\n{CLOSE}" for o in objs)
    return f"{OPEN}{json.dumps(objs)}{CLOSE}"


@dataclass
class CallDelta:
    """A piece of one call: the first carries id and name, later ones pieces of arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text of the arguments object

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


_HEAD = re.compile(r'^\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                   r"\s*:\s*$", re.S)


class CallScanner:
    """Reads calls written as JSON: one object `{"name", "arguments"}`, several, or a list of
    them. Only JSON structure is tracked (strings, escapes, depth), so pieces of arguments go
    out as they arrive; an object whose keys come in another order is parsed when it closes.

    Given `name` (a named tool_choice), the whole text is that call's arguments object."""

    def __init__(self, name: str | None = None) -> None:
        self.calls: list[ToolCall] = []
        self.phase = "between"  # between | head | args | tail | bare-args
        self.buf = ""  # the current call object, until its arguments start
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.announce: CallDelta | None = None  # a named call's first delta, not yet given
        if name is not None:
            self.announce = self._start(name)
            self.phase = "bare-args"

    @property
    def between_calls(self) -> bool:
        return self.phase == "between"

    def feed(self, text: str) -> list[CallDelta]:
        out: list[CallDelta] = []
        if self.announce is not None:
            out.append(self.announce)
            self.announce = None
        for ch in text:
            self._char(ch, out)
        return _merge(out)

    def _start(self, name: str) -> CallDelta:
        self.calls.append(ToolCall(new_call_id(), name, ""))
        return CallDelta(len(self.calls) - 1, self.calls[-1].id, name)

    def _args(self, piece: str, out: list[CallDelta]) -> None:
        self.calls[-1].arguments += piece
        out.append(CallDelta(len(self.calls) - 1, arguments=piece))

    def _char(self, ch: str, out: list[CallDelta]) -> None:
        quoted = self.in_string
        if quoted:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        opens = not quoted and ch in "{["
        closes = not quoted and ch in "}]"
        if self.phase == "between":
            if ch == "{" and not quoted:
                self.phase, self.buf, self.depth = "head", "{", 1
            return  # `[`, `,`, `]` and blanks between calls
        if self.phase == "head" and ch == "{" and self.depth == 1 and not quoted \
                and (m := _HEAD.match(self.buf)):
            out.append(self._start(json.loads(f'"{m.group(1)}"')))
            self.phase, self.depth = "args", 2
            self._args("{", out)
            return
        self.depth += opens - closes
        if self.phase in ("args", "bare-args"):
            if self.phase == "bare-args" and self.depth == 0 and not closes and ch.isspace():
                return
            self._args(ch, out)
            if self.phase == "args" and self.depth == 1:
                self.phase = "tail"
            return
        if self.phase == "head":
            self.buf += ch
        if self.depth == 0:  # the call object closed
            if self.phase == "head":
                out.extend(self._whole_object(self.buf))
            self.phase, self.buf = "between", ""

    def _whole_object(self, text: str) -> list[CallDelta]:
        """A call object whose arguments did not come right after its name: parse it whole."""
        try:
            obj = json.loads(text)
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("arguments", obj.get("parameters", {}))
        start = self._start(obj["name"])
        self.calls[-1].arguments = args if isinstance(args, str) else json.dumps(args)
        return [start, CallDelta(start.index, arguments=self.calls[-1].arguments)]


def _merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Consecutive pieces of one call become one delta."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and d.id is None and out[-1].index == d.index:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolCallParser:
    """A reply's text, streamed or whole, split into content and tool calls.

    `tagged`: calls come inside <tool_call> tags among content (`tool_choice: auto`); else the
    whole reply is calls, which a grammar forced (`required`, or the function `name`d)."""

    def __init__(self, tagged: bool = True, name: str | None = None) -> None:
        self.tagged = tagged
        self.scanner = CallScanner(name=name)
        self.pending = ""  # held back: a possible tag, or the start of an end tag
        self.tag_text = ""  # what the open tag enclosed so far
        self.in_tag = False

    @property
    def calls(self) -> list[ToolCall]:
        return self.scanner.calls

    def feed(self, text: str) -> ParsedDelta:
        if not self.tagged:
            return ParsedDelta("", self.scanner.feed(text))
        self.pending += text
        out = ParsedDelta()
        while self.pending:
            if not self.in_tag:
                at = self.pending.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self.pending, OPEN)
                    out.content += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                out.content += self.pending[:at]
                self.pending = self.pending[at + len(OPEN):]
                self.in_tag, self.tag_text = True, ""
                continue
            i = 0
            while i < len(self.pending):
                rest = self.pending[i:]
                if self.scanner.between_calls and rest[0] == "<" and (
                        rest.startswith(CLOSE) or CLOSE.startswith(rest)):
                    break  # the end tag, whole or still arriving
                out.calls += self.scanner.feed(rest[0])
                self.tag_text += rest[0]
                i += 1
            self.pending = self.pending[i:]
            if not self.pending.startswith(CLOSE):
                break
            self.pending = self.pending[len(CLOSE):]
            self.in_tag = False
        out.calls = _merge(out.calls)
        return out

    def finish(self) -> ParsedDelta:
        """The reply ended: what is still held back. A partial tag that never opened is
        content; so is an open tag in which no call could be read."""
        if not self.tagged:
            return ParsedDelta()
        rest, self.pending = self.pending, ""
        if self.in_tag:
            rest = "" if self.calls else OPEN + self.tag_text + rest
        return ParsedDelta(rest)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse(text: str, tagged: bool = True, name: str | None = None) -> tuple[str, list[ToolCall]]:
    """A whole reply: (content, calls)."""
    p = ToolCallParser(tagged, name)
    content = p.feed(text).content + p.finish().content
    return content, p.calls


MAX_PARALLEL_TOOL_CALLS = 8  # calls in one reply under `required` with parallel calls allowed


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """`tool_choice: "required"`: a list of one call (`parallel_tool_calls: false`) or of 1 to
    MAX_PARALLEL_TOOL_CALLS calls, each to a known tool with valid arguments (what vLLM and
    SGLang constrain to). The bound is what ends the reply: a small model tends to write the
    same call again and again, and without it the list only ended with the budget."""
    calls = [{"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": t["function"].get("parameters") or {"type": "object"}}}
             for t in tools]
    return {"type": "array", "minItems": 1,
            "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1,
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
