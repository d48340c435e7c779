"""Tool-call formats: rendered into prompts, read back from replies, streamed or whole."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from common.messages import StructuredOutputs
from common.tool_calls import (
    MAX_PARALLEL_TOOL_CALLS,
    ToolCallParser,
    parse,
    render_calls,
    required_schema,
    system_prompt,
)

XLAM = ('Sure! <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": {"n": [1, 2]}}}, {"name": "get_time", "arguments": {}}]</tool_call>')
HERMES = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a}b\\"c"}}\n</tool_call>'
          '\n<tool_call>\n{"arguments": {"x": 1}, "name": "late_name"}\n</tool_call>')


def _stream(text: str, seed: int, tagged: bool = True, name: str | None = None):
    """Feed the text in random pieces; join what comes out as a client would."""
    rng = random.Random(seed)
    parser = ToolCallParser(tagged, name)
    content, calls, i = "", {}, 0
    while i < len(text):
        n = rng.randint(1, 6)
        delta = parser.feed(text[i:i + n])
        i += n
        content += delta.content
        for c in delta.calls:
            if c.id is not None:  # a call's first delta: its id and name, before any argument
                assert c.index not in calls and c.name
                calls[c.index] = [c.name, c.arguments]
            else:
                calls[c.index][1] += c.arguments
        assert "<tool" not in content and "tool_call>" not in content  # never a partial tag
    content += parser.finish().content
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("text, content, calls", [
    (XLAM, "Sure! ", [("get_weather", '{"city": "Paris", "days": {"n": [1, 2]}}'),
                      ("get_time", "{}")]),
    (HERMES, "\n", [("get_weather", '{"city": "a}b\\"c"}'), ("late_name", '{"x": 1}')]),
    ("no calls < here, a <tool", "no calls < here, a <tool", []),
    ('<tool_call>[{"name": "f", "argu', '<tool_call>[{"name": "f", "argu', []),
])
def test_streamed_calls_join_to_the_whole_reply(text, content, calls):
    whole_content, whole_calls = parse(text)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    for seed in range(20):
        assert _stream(text, seed) == (content, calls)


def test_forced_calls_without_tags():
    text = '[{"name": "f", "arguments": {"a": "}"}}, {"name": "g", "arguments": {"b": 2}}]'
    assert [(c.name, c.arguments) for c in parse(text, tagged=False)[1]] == [
        ("f", '{"a": "}"}'), ("g", '{"b": 2}')]
    named = '{"city": "Oslo", "n": {"deep": [1]}}'
    assert [(c.name, c.arguments) for c in parse(named, tagged=False, name="f")[1]] == [
        ("f", named)]
    assert _stream(named, 3, tagged=False, name="f") == ("", [("f", named)])


def test_history_calls_are_rendered_in_the_format():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert render_calls("xlam", [call]) == '<tool_call>[{"name": "f", "arguments": {"a": 1}}]' \
        "</tool_call>"
    assert render_calls("hermes", [call]) == '<tool_call>\n{"name": "f", "arguments": {"a": 1}}' \
        "\n</tool_call>"
    # what the format writes, the parser reads back
    for fmt in ("xlam", "hermes"):
        assert [(c.name, c.arguments) for c in parse(render_calls(fmt, [call]))[1]] == [
            ("f", '{"a": 1}')]


def test_system_prompt_lists_the_tools():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    assert '"name": "get_weather"' in system_prompt("xlam", tools)
    assert '"type": "function"' in system_prompt("hermes", tools)


def test_required_schema_allows_only_known_tools():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools, parallel=False)
    jsonschema.validate([{"name": "f", "arguments": {"a": 1}}], schema)
    for bad in ([], [{"name": "h", "arguments": {}}], [{"name": "f", "arguments": {}}],
                [{"name": "g", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert StructuredOutputs(json=json.dumps(schema)).kinds() == ["json"]


def test_required_schema_bounds_parallel_calls():
    tools = [{"type": "function", "function": {"name": "f"}}]
    call = {"name": "f", "arguments": {}}
    schema = required_schema(tools, parallel=True)
    jsonschema.validate([call] * MAX_PARALLEL_TOOL_CALLS, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([call] * (MAX_PARALLEL_TOOL_CALLS + 1), schema)
