"""Structured outputs and tool calls through the whole stack with the real SmolLM2, over the
official `openai` client and plain HTTP: every constraint field the anchors name, tool calls
streamed and not, and a 400 naming the field for every bad input."""

from __future__ import annotations

import json
import re
import time

import aiohttp
import jsonschema
import pytest
import requests

from tests.e2e.reliability import assert_openai_error
from tests.helpers import Stack, metric

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
          "properties": {"name": {"type": "string", "maxLength": 30},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 30}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def stack():
    with Stack("--max-total-tokens", "30000") as s:
        yield s


@pytest.fixture
def client(stack):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def _model(client) -> str:
    return (await client.models.list()).data[0].id


async def _stream_chat(client, **kw) -> tuple[str, list[dict], str | None]:
    """Join a streamed chat reply as a client would: content, calls by index, finish."""
    content, calls, finish = "", {}, None
    first_seen: dict[int, dict] = {}
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call: id, type and name
                assert tc.id and tc.type == "function" and tc.function.name, tc
                first_seen[tc.index] = {"id": tc.id}
                calls[tc.index] = {"name": tc.function.name,
                                   "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not (tc.function.name or "")
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    assert "<tool_call" not in content  # a tag never leaks into content
    return content, [calls[i] for i in sorted(calls)], finish


def _calls(message) -> list[dict]:
    return [{"name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


# -- response_format, structured_outputs, /generate ---------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
async def test_response_format_json_schema_streamed_and_not(client, temperature):
    kw = dict(model=await _model(client), temperature=temperature, seed=7, max_tokens=120,
              messages=[{"role": "user", "content": "Invent a person. Reply in JSON."}],
              response_format={"type": "json_schema",
                               "json_schema": {"name": "person", "schema": PERSON,
                                               "strict": True}})
    whole = await client.chat.completions.create(**kw)
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    assert whole.choices[0].finish_reason == "stop"
    streamed, calls, finish = await _stream_chat(client, **kw)
    assert (streamed, calls, finish) == (text, [], "stop")


async def test_response_format_json_object_parses(client):
    out = await client.chat.completions.create(
        model=await _model(client), temperature=0, max_tokens=150,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)


async def test_structured_outputs_in_extra_body(client):
    model = await _model(client)
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    out = await client.completions.create(
        model=model, prompt="The date of the meeting is", max_tokens=20, temperature=0.7,
        seed=1, extra_body={"structured_outputs": {"regex": date}})
    assert re.fullmatch(date, out.choices[0].text), out.choices[0].text
    out = await client.chat.completions.create(
        model=model, max_tokens=10, temperature=0,
        messages=[{"role": "user", "content": "Is the sun hot? yes or no"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    ebnf = 'root ::= "(" [1-9] [0-9]* (" + " [1-9] [0-9]*)* ")"'
    out = await client.completions.create(
        model=model, prompt="A sum:", max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"grammar": ebnf}})
    assert re.fullmatch(r"\([1-9][0-9]*( \+ [1-9][0-9]*)*\)", out.choices[0].text)
    out = await client.chat.completions.create(
        model=model, max_tokens=120, temperature=0, n=2, seed=3,
        messages=[{"role": "user", "content": "Invent a person as JSON."}],
        extra_body={"structured_outputs": {"json": PERSON}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


async def test_generate_sampling_params_constraints(stack):
    async with aiohttp.ClientSession() as http:
        for sp, check in [
            ({"json_schema": json.dumps(PERSON)},
             lambda t: jsonschema.validate(json.loads(t), PERSON)),
            ({"regex": "[A-Z][a-z]{2,9}"}, lambda t: re.fullmatch("[A-Z][a-z]{2,9}", t)),
            ({"ebnf": 'root ::= "ok" | "not ok"'}, lambda t: t in ("ok", "not ok")),
        ]:
            body = {"text": "Answer:", "sampling_params": {"max_new_tokens": 100,
                                                            "temperature": 0, **sp}}
            async with http.post(f"{stack.url}/generate", json=body) as r:
                assert r.status == 200, await r.text()
                out = await r.json()
            assert check(out["text"]) is not False, (sp, out["text"])
            assert out["meta_info"]["finish_reason"]["type"] == "stop"


# -- tool calls ----------------------------------------------------------------------------------
async def test_tool_choice_required_streamed_equals_whole(client):
    kw = dict(model=await _model(client), messages=ASK_WEATHER, tools=TOOLS, temperature=0,
              max_tokens=100, tool_choice="required")
    whole = await client.chat.completions.create(**kw)
    choice = whole.choices[0]
    calls = _calls(choice.message)
    assert calls and choice.finish_reason == "tool_calls"
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    assert choice.message.tool_calls[0].id.startswith("call_")
    content, streamed, finish = await _stream_chat(client, **kw)
    assert streamed == calls and finish == "tool_calls" and content == ""


@pytest.mark.parametrize("temperature", [0.0, 0.9])
async def test_named_tool_choice_returns_that_call(client, temperature):
    kw = dict(model=await _model(client), messages=ASK_WEATHER, tools=TOOLS, seed=2,
              temperature=temperature, max_tokens=80,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = await client.chat.completions.create(**kw)
    [call] = _calls(whole.choices[0].message)
    assert call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_time"])
    assert whole.choices[0].finish_reason == "tool_calls"
    _, streamed, finish = await _stream_chat(client, **kw)
    assert streamed == [call] and finish == "tool_calls"


async def test_auto_tool_choice_parses_the_models_own_format(client):
    # SmolLM2-135M, asked cold, answers in prose (it was not trained on tool calls); after one
    # earlier exchange in its format it writes the call itself, unconstrained
    berlin = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}
    history = [{"role": "user", "content": "What is the weather in Berlin?"},
               {"role": "assistant", "content": None, "tool_calls": [berlin]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
               {"role": "assistant", "content": "It is 18 degrees in Berlin."},
               {"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=await _model(client), messages=history, tools=[WEATHER],
              temperature=0, max_tokens=80)
    whole = await client.chat.completions.create(**kw)
    choice = whole.choices[0]
    calls = _calls(choice.message)
    assert [c["name"] for c in calls] == ["get_weather"], choice.message
    assert json.loads(calls[0]["arguments"])["city"] == "Paris"
    assert choice.finish_reason == "tool_calls"
    content, streamed, finish = await _stream_chat(client, **kw)
    assert streamed == calls and finish == "tool_calls"
    assert (content or None) == choice.message.content


async def test_multi_turn_with_a_tool_result(client):
    model = await _model(client)
    first = await client.chat.completions.create(
        model=model, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    history = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "unit": "celsius", "sky": "sunny"})}]
    second = await client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=60)
    answer = second.choices[0].message
    assert answer.content and not answer.tool_calls
    assert second.choices[0].finish_reason in ("stop", "length")


# -- bad input ----------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param, words", [
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", ["nonsense"]),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}},
     "response_format.json_schema", []),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type", []),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex", []),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs.grammar", ["nothing"]),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{not json"}},
     "structured_outputs.json", []),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", ["unknown field"]),  # a vLLM field we lack
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a+"}},
     "response_format", ["response_format and structured_outputs.regex"]),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     "sampling_params.regex", ["sampling_params.regex and sampling_params.ebnf"]),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{\"type\": 5}"}},
     "sampling_params.json_schema", []),
    (CHAT, {"messages": MSG, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", ["nope"]),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, "tool_choice", []),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": 3}}]}, "tools[0].function.parameters", []),
    (CHAT, {"messages": MSG, "tools": [{"type": "retrieval"}]}, "tools[0].type", []),
    (CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}},
     "response_format", ["tool_choice"]),
    (CHAT, {"messages": MSG + [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[1].tool_calls[0]", []),
])
def test_bad_input_gets_a_400_naming_the_field(stack, path, body, param, words):
    short = {} if path == "/generate" else {"max_tokens": 8}  # /generate has max_new_tokens
    resp = requests.post(stack.url + path, json={**short, **body}, timeout=60)
    assert_openai_error(resp, 400, param, *words)
    ok = requests.post(stack.url + "/v1/completions",
                       json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert ok.status_code == 200, ok.text


def test_streamed_bad_constraint_is_a_400_before_any_event(stack):
    resp = requests.post(stack.url + "/v1/completions", timeout=60, json={
        "prompt": "x", "stream": True, "structured_outputs": {"regex": "(a"}})
    assert_openai_error(resp, 400, "structured_outputs.regex")


def test_metrics_and_server_info_name_the_grammar_backend(stack):
    info = requests.get(stack.url + "/get_server_info", timeout=10).json()
    assert info["grammar_backend"] == "xgrammar"
    body = {"prompt": "Pick one:", "max_tokens": 4,
            "structured_outputs": {"choice": ["metrics one", "metrics two"]}}
    for _ in range(2):  # the same constraint twice: the second finds it compiled
        assert requests.post(stack.url + "/v1/completions", json=body, timeout=60).ok
    for _ in range(100):  # the schedulers' next heartbeat brings the counts
        text = requests.get(stack.url + "/metrics", timeout=10).text
        if metric(text, "tokenline:grammar_cache_hits_total") > 0:
            break
        time.sleep(0.1)
    assert metric(text, "tokenline:structured_output_requests_total") >= 2
    assert metric(text, "tokenline:grammar_cache_hits_total") >= 1
    assert metric(text, "tokenline:grammar_compile_seconds_count") >= 1
