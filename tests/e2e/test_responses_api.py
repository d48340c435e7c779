"""OpenAI's Responses API (`POST /v1/responses`) through one stack of the real SmolLM2, over the
official `openai` client: the same reply as the chat completion of the same conversation,
streamed as the documented events, tools and text.format through chat's own constraint, and
a 400 naming the field for what this server does not do (it keeps no responses)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers import Stack

INSTRUCTIONS = "You are a helpful assistant. Answer in one sentence."
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a given city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 40}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done",
               "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _dedupe(kinds: list[str]) -> list[str]:
    """Event types with runs of one type (the deltas) collapsed to one."""
    return [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]


def test_output_text_is_the_chat_completions_reply(client, model):
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": INSTRUCTIONS},
                             {"role": "user", "content": QUESTION}],
        temperature=0, max_tokens=24)
    resp = client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION,
                                   temperature=0, max_output_tokens=24)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].type == "message" and resp.output[0].role == "assistant"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    # the same prompt again: its blocks come from the prefix cache
    again = client.responses.create(model=model, input=[
        {"type": "message", "role": "system", "content": INSTRUCTIONS},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                          "text": QUESTION}]}],
        temperature=0, max_output_tokens=24, store=False, user="u-1", metadata={"k": "v"})
    assert again.output_text == resp.output_text
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_stream_events_come_in_order_and_join_to_the_reply(client, model):
    whole = client.responses.create(model=model, instructions=INSTRUCTIONS, input=QUESTION,
                                    temperature=0, max_output_tokens=16)
    events = list(client.responses.create(model=model, instructions=INSTRUCTIONS,
                                          input=QUESTION, temperature=0,
                                          max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    final = events[-1].response
    done = "response.completed" if final.status == "completed" else "response.incomplete"
    assert _dedupe(kinds) == TEXT_EVENTS[:-1] + [done]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text
    text_done = next(e for e in events if e.type == "response.output_text.done")
    assert text_done.text == deltas
    item = next(e for e in events if e.type == "response.output_item.done").item
    assert item.id == final.output[0].id == text_done.item_id
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_max_output_tokens_ends_incomplete(client, model):
    resp = client.responses.create(model=model, input="Write a long story about a dragon.",
                                   max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3
    with client.responses.stream(model=model, input="Write a long story about a dragon.",
                                 max_output_tokens=3) as stream:
        events = list(stream)  # the SDK's helper keeps a final response for completed only
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.usage.output_tokens == 3


def test_function_call_then_its_output_next_turn(client, model):
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    resp = client.responses.create(model=model, input=ask, tools=[WEATHER],
                                   tool_choice="required", temperature=0,
                                   max_output_tokens=60)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", resp.output
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                     "arguments": calls[0].arguments},
                    {"type": "function_call_output", "call_id": calls[0].call_id,
                     "output": json.dumps({"temperature_c": 21, "sky": "clear"})}]
    second = client.responses.create(model=model, input=follow, tools=[WEATHER],
                                     temperature=0, max_output_tokens=8)
    assert second.status in ("completed", "incomplete") and second.output


def test_streamed_function_call_arguments_join_to_the_call(client, model):
    events = list(client.responses.create(
        model=model, input="What is the weather like in Paris today?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
        max_output_tokens=60, stream=True))
    kinds = _dedupe([e.type for e in events])
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done",
                         "response.completed"], kinds
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    call = events[-1].response.output[0]
    assert call.type == "function_call" and call.arguments == args
    jsonschema.validate(json.loads(args), WEATHER["parameters"])


def test_text_format_json_schema_validates(client, model):
    resp = client.responses.create(
        model=model, input="Invent a person: give a name and an age as JSON.", temperature=0,
        max_output_tokens=60, text={"format": {"type": "json_schema", "name": "person",
                                               "schema": PERSON, "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(("field", "kw"), [
    ("store", {"store": True}),
    ("previous_response_id", {"previous_response_id": "resp_123"}),
    ("input[0].type", {"input": [{"type": "reasoning", "summary": []}]}),
    ("tools[0].type", {"tools": [{"type": "web_search"}]}),
    ("include", {"include": ["reasoning.encrypted_content"]}),
    ("truncation", {"truncation": "auto"}),
    ("text.format.schema", {"text": {"format": {"type": "json_schema", "name": "p"}}}),
    ("input[0].call_id", {"input": [{"type": "function_call_output", "call_id": "c9",
                                     "output": "1"}]}),
])
def test_what_is_not_done_is_a_400_naming_the_field(client, model, field, kw):
    body = {"model": model, "input": "hi", "max_output_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert info.value.param == field, info.value.body
