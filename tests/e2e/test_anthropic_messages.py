"""Anthropic's Messages API (`POST /v1/messages`) through one stack of the real SmolLM2, over the
official `anthropic` client and plain HTTP.

The route is the chat completion its request translates to: the same greedy text as
/v1/chat/completions for the same conversation, streamed in Anthropic's events (the `event:`
names the SDK reads), tool calls through the same grammar and parser as tool_use blocks, and
every refusal in Anthropic's error body with the field named.
"""

from __future__ import annotations

import json

import anthropic
import pytest
import requests

from tests.helpers import Stack

KEY = "sk-ant-test"
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
ASK = [{"role": "user", "content": QUESTION}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a given city",
           "input_schema": {"type": "object", "additionalProperties": False,
                            "required": ["city"],
                            "properties": {"city": {"type": "string", "maxLength": 40}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# the SDK (2.x) no longer has temperature, top_p, top_k: sent as the API takes them
GREEDY = {"temperature": 0}
EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
          "message_delta", "message_stop")


@pytest.fixture(scope="module")
def stack():
    with Stack("--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def model(stack) -> str:
    return requests.get(stack.url + "/v1/models", timeout=10,
                        headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy(client, model) -> anthropic.types.Message:
    return client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=24,
                                  extra_body=GREEDY)


def _sse(stack, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed reply, as sent."""
    resp = requests.post(stack.url + "/v1/messages", json={**body, "stream": True}, timeout=120,
                         headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"})
    assert resp.status_code == 200, resp.text
    events = []
    for frame in resp.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        assert set(lines) == {"event", "data"}, frame
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_greedy_text_equals_the_chat_completion_of_the_same_conversation(stack, model, greedy):
    from openai import OpenAI

    chat = OpenAI(base_url=stack.url + "/v1", api_key=KEY, max_retries=0)
    want = chat.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, *ASK], max_tokens=24,
        temperature=0)
    text = want.choices[0].message.content
    assert greedy.id.startswith("msg_") and greedy.role == "assistant" and greedy.model == model
    assert [b.type for b in greedy.content] == ["text"] and greedy.content[0].text == text
    reason = {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    assert greedy.stop_reason == reason and greedy.stop_sequence is None
    u = greedy.usage
    assert u.input_tokens + u.cache_read_input_tokens == want.usage.prompt_tokens
    assert u.output_tokens == want.usage.completion_tokens


def test_stream_sends_anthropics_events_and_the_same_text(stack, client, model, greedy):
    body = {"model": model, "system": SYSTEM, "messages": ASK, "max_tokens": 24,
            "temperature": 0}
    events = _sse(stack, body)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:2] == ["message_start", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] == (
        greedy.usage.input_tokens + greedy.usage.cache_read_input_tokens)
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == greedy.content[0].text
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": greedy.stop_reason, "stop_sequence": None}
    assert end["usage"]["output_tokens"] == greedy.usage.output_tokens

    sdk = {k: v for k, v in body.items() if k != "temperature"}
    with client.messages.stream(**sdk, extra_body=GREEDY) as stream:  # as the SDK reads it
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy.content[0].text == final.content[0].text
    assert final.stop_reason == greedy.stop_reason
    assert final.usage.output_tokens == greedy.usage.output_tokens


def test_max_tokens_and_stop_sequences_give_their_stop_reasons(client, model, greedy):
    short = client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=3,
                                   extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    text = greedy.content[0].text
    word = text.split()[2]  # a word the greedy reply writes
    cut = client.messages.create(model=model, system=SYSTEM, messages=ASK, max_tokens=24,
                                 extra_body=GREEDY, stop_sequences=["zzzq", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[:text.index(word)]


def test_tool_use_round_trip(stack, client, model):
    kw = dict(model=model, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60,
              extra_body=GREEDY, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    first = client.messages.create(**kw)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)
    with client.messages.stream(**kw) as stream:  # streamed: input_json_delta pieces
        streamed = stream.get_final_message()
    (scall,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (scall.name, scall.input) == (call.name, call.input)
    assert streamed.stop_reason == "tool_use"
    events = _sse(stack, {**{k: v for k, v in kw.items() if k != "extra_body"}, **GREEDY})
    (start,) = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert start["type"] == "tool_use" and start["input"] == {} and start["name"] == call.name
    pieces = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert {p["type"] for p in pieces} == {"input_json_delta"}
    assert json.loads("".join(p["partial_json"] for p in pieces)) == call.input

    history = [*ASK_WEATHER, {"role": "assistant", "content": first.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                             "content": '{"temperature": 21, "sky": "sunny"}'}]}]
    answer = client.messages.create(model=model, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"}, max_tokens=20,
                                    extra_body=GREEDY)
    assert answer.content[0].type == "text" and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")


REFUSED = {  # what the body carries -> words the error message must contain
    "thinking": ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, ["thinking"]),
    "image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
        ["messages[0].content[0].type", "image"]),
    "tool_result without its tool_use": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]},
        ["toolu_nope", "tool_use"]),
    "tool_use without its tool_result": ({"messages": [
        *ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": "and?"}]}, ["toolu_1", "tool_result"]),
    "prefill": ({"messages": [*ASK, {"role": "assistant", "content": "The answer is"}]},
                ["messages[1]", "prefill"]),
    "a server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                      ["tools[0]"]),
    "mcp_servers": ({"mcp_servers": []}, ["mcp_servers"]),
    "service_tier": ({"service_tier": "priority"}, ["service_tier"]),
    "too many stop sequences": ({"stop_sequences": list("abcdefghijklmnopq")},
                                ["stop_sequences"]),
    "temperature above 1": ({"temperature": 1.5}, ["temperature"]),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_refusals_name_the_field_in_anthropics_shape(stack, client, model, case):
    extra, words = REFUSED[case]
    known = {k: v for k, v in extra.items() if k not in ("mcp_servers", "temperature")}
    body = {"model": model, "max_tokens": 8, "messages": ASK, **known}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**body, extra_body={k: extra[k] for k in extra.keys() - known})
    assert info.value.status_code == 400
    err = info.value.body
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"}, err
    assert err["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in err["error"]["message"], err


def test_other_errors_keep_anthropics_shape(stack, client):
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=8, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in info.value.body["error"]["message"]
    body = {"model": "x", "max_tokens": 8, "messages": ASK}
    for headers in ({}, {"x-api-key": "wrong"}):
        resp = requests.post(stack.url + "/v1/messages", json=body, headers=headers, timeout=10)
        assert resp.status_code == 401
        assert resp.json()["error"]["type"] == "authentication_error", resp.text
    resp = requests.get(stack.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=10)
    assert resp.status_code == 405 and resp.json()["type"] == "error"
    resp = requests.post(stack.url + "/v1/messages", data=b'{"model": ', timeout=10,
                         headers={"x-api-key": KEY, "Content-Type": "application/json"})
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
    # the OpenAI routes keep OpenAI's body, and x-api-key opens only Anthropic's
    resp = requests.post(stack.url + "/v1/chat/completions", json={"messages": ASK},
                         headers={"x-api-key": KEY}, timeout=10)
    assert resp.status_code == 401 and set(resp.json()["error"]) >= {"message", "param"}
