"""vLLM's /tokenize and /detokenize, and the OpenAI fields that change nothing here, through one
stack of the real SmolLM2 over HTTP and the official `openai` client.

/tokenize gives the ids the tokenizer gives, and for `messages` the ids a chat completion is
scheduled with (its count is the completion's prompt_tokens); /detokenize gives the text back.
`user`, `metadata`, `store: false`, `service_tier`, `prediction` and `reasoning_effort` are
served as if absent; `stream_options` does what it says; every field that would change
something we do not do is a 400 naming it.
"""

from __future__ import annotations

import json

import aiohttp
import pytest
from tokenizers import Tokenizer

from common.modelstore import model_info
from tests.helpers import Stack

TEXT = "Tokenizers split text: Café ☕, 42 and naïve words."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 40}}}}}
METADATA = {"team": "evals", "run": "r" * 512, "k" * 64: "v"}


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


@pytest.fixture(scope="module")
def tok(smol_path) -> Tokenizer:
    return Tokenizer.from_file(str(model_info(smol_path).tokenizer_json))


@pytest.fixture
def client(stack):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as r:
            return r.status, await r.json()


async def _ok(url: str, path: str, body: dict) -> dict:
    status, out = await _post(url, path, body)
    assert status == 200, out
    return out


async def _refused(url: str, path: str, body: dict, param: str, status: int = 400) -> str:
    got, out = await _post(url, path, body)
    assert got == status, (body, out)
    assert out["error"]["param"] == param, (body, out)
    return out["error"]["message"]


async def _events(url: str, path: str, body: dict) -> list[dict]:
    chunks = []
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                line = line.strip()
                if line.startswith(b"data: ") and line != b"data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    return chunks


async def test_tokenize_a_prompt_gives_the_tokenizers_ids_and_detokenize_the_text(stack, tok):
    out = await _ok(stack.url, "/tokenize", {"prompt": TEXT})
    ids = tok.encode(TEXT, add_special_tokens=True).ids
    async with aiohttp.ClientSession() as http:
        async with http.get(stack.url + "/v1/models") as r:
            model = (await r.json())["data"][0]
    assert out == {"count": len(ids), "max_model_len": model["max_model_len"], "tokens": ids,
                   "token_strs": None}
    bare = await _ok(stack.url, "/tokenize", {"model": model["id"], "prompt": TEXT,
                                             "add_special_tokens": False,
                                             "return_token_strs": True})
    bare_ids = tok.encode(TEXT, add_special_tokens=False).ids
    assert bare["tokens"] == bare_ids
    assert bare["token_strs"] == [tok.id_to_token(i) for i in bare_ids]
    assert (await _ok(stack.url, "/detokenize", {"tokens": ids}))["prompt"] == TEXT
    # the ids a completion of that prompt is charged for
    done = await _ok(stack.url, "/v1/completions", {"prompt": TEXT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == out["count"]


async def test_tokenize_messages_counts_what_a_chat_completion_is_charged(stack, client, tok):
    out = await _ok(stack.url, "/tokenize", {"messages": QUESTION})
    model = (await client.models.list()).data[0].id
    chat = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1)
    assert out["count"] == chat.usage.prompt_tokens == len(out["tokens"])
    text = (await _ok(stack.url, "/detokenize", {"tokens": out["tokens"]}))["prompt"]
    assert "<|im_start|>user\nWhat is the capital of France?" in text  # special tokens kept
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert tok.encode(text, add_special_tokens=False).ids == out["tokens"]
    shorter = await _ok(stack.url, "/tokenize", {"messages": QUESTION,
                                                 "add_generation_prompt": False})
    assert out["tokens"][:shorter["count"]] == shorter["tokens"] and shorter["count"] < out["count"]
    # tools are rendered into the prompt as a chat completion renders them
    tools = await _ok(stack.url, "/tokenize", {"messages": QUESTION, "tools": [WEATHER]})
    with_tools = await client.chat.completions.create(
        model=chat.model, messages=QUESTION, tools=[WEATHER], tool_choice="none", max_tokens=1)
    assert tools["count"] == with_tools.usage.prompt_tokens > out["count"]


async def test_tokenize_and_detokenize_refuse_what_they_do_not_do_by_name(stack):
    url = stack.url
    assert "exactly one" in await _refused(url, "/tokenize", {"prompt": "hi",
                                                              "messages": QUESTION}, "prompt")
    await _refused(url, "/tokenize", {}, "prompt")
    await _refused(url, "/tokenize", {"prompt": "hi", "add_generation_prompt": True},
                   "add_generation_prompt")
    for field, value in (("continue_final_message", True), ("chat_template_kwargs", {"x": 1}),
                         ("chat_template", "{{ messages }}"), ("mm_processor_kwargs", {})):
        message = await _refused(url, "/tokenize", {"messages": QUESTION, field: value}, field)
        assert field in message
    await _refused(url, "/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]},
                   "messages[0].role")
    await _refused(url, "/tokenize", {"model": "gpt-17", "prompt": "hi"}, "model", 404)
    assert "vocabulary" in await _refused(url, "/detokenize", {"tokens": [1, 10**9]}, "tokens")
    await _refused(url, "/detokenize", {"tokens": [-1]}, "tokens[0]")


async def test_openai_fields_that_change_nothing_are_served_as_if_absent(stack, client):
    model = (await client.models.list()).data[0].id
    plain = await client.chat.completions.create(model=model, messages=QUESTION, max_tokens=8,
                                                 temperature=0)
    stream = await client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, user="user-1", metadata=METADATA, store=False,
        service_tier="auto", prediction={"type": "content", "content": "Paris is the capital"},
        reasoning_effort="low", parallel_tool_calls=False)
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    last = chunks[-1]  # include_usage: one chunk more, no choices, the whole usage
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)


async def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(stack):
    body = {"prompt": TEXT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = await _events(stack.url, "/v1/completions", body)
    *outputs, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in outputs]
    assert counts == sorted(counts) and counts[-1] == 6 and len(outputs) > 1
    for c in chunks:
        u = c["usage"]
        assert u["prompt_tokens"] == last["usage"]["prompt_tokens"] > 0
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


async def test_openai_fields_that_would_change_something_are_refused_by_name(stack, client):
    import openai

    model = (await client.models.list()).data[0].id
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=model, messages=QUESTION, store=True)
    assert info.value.param == "store" and "store" in str(info.value)
    chat = "/v1/chat/completions"
    too_many = {f"k{i}": "v" for i in range(17)}
    for body, param in (
            ({"metadata": too_many}, "metadata"),
            ({"metadata": {"k": "v" * 513}}, "metadata[...]"),
            ({"metadata": {"k" * 65: "v"}}, "metadata"),
            ({"metadata": {"k": 1}}, "metadata[...]"),
            ({"service_tier": "gold"}, "service_tier"),
            ({"reasoning_effort": "maximal"}, "reasoning_effort"),
            ({"prediction": {"type": "audio", "content": "x"}}, "prediction.type"),
            ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
             "stream_options.continuous_usage_stats"),
            ({"modalities": ["text", "audio"]}, "modalities"),  # unknown: its 400 stays
    ):
        await _refused(stack.url, chat, {"messages": QUESTION, "max_tokens": 1, **body}, param)


async def test_parallel_tool_calls_false_gives_one_call_where_the_model_would_write_more(
        client, tok):
    """SmolLM2 writes one call by itself; kept from closing the list (no token with a `]`), it
    writes more, unless parallel_tool_calls is false: then the grammar closes it after one."""
    model = (await client.models.list()).data[0].id
    no_close = {str(i): -100 for i in range(tok.get_vocab_size()) if "]" in tok.decode([i])}
    replies = [await client.chat.completions.create(
        model=model, max_tokens=60, temperature=0, tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=parallel, logit_bias=no_close,
        messages=[{"role": "user", "content": "What is the weather in Paris and in Berlin?"}])
        for parallel in (True, False)]
    several, one = (r.choices[0] for r in replies)
    assert len(several.message.tool_calls) > 1
    assert len(one.message.tool_calls) == 1 and one.finish_reason == "tool_calls"
    assert json.loads(one.message.tool_calls[0].function.arguments) == json.loads(
        several.message.tool_calls[0].function.arguments)
