"""The whole stack through `tokenline serve` with the real SmolLM2, over real HTTP clients."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.helpers import Stack

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


async def _chat(url: str, **body) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _stream(url: str, path: str, **body) -> tuple[list[dict], bool]:
    chunks, done = [], False
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    done = True
                    continue
                chunks.append(json.loads(line[6:]))
    return chunks, done


async def test_greedy_chat_answers_paris(stack):
    out = await _chat(stack.url, messages=QUESTION, temperature=0, max_tokens=32)
    choice = out["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = out["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_streamed_and_unstreamed_text_are_equal(stack):
    body = dict(messages=[{"role": "user", "content": "Name three fruits."}], temperature=0,
                max_tokens=40)
    whole = await _chat(stack.url, **body)
    chunks, done = await _stream(stack.url, "/v1/chat/completions", **body,
                                 stream_options={"include_usage": True})
    assert done
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == whole["choices"][0]["finish_reason"]
    usage = chunks[-1]["usage"]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[field] == whole["usage"][field], field
    # the stream re-sent the same prompt: every full block of it but the last token's is cached
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/get_server_info") as r:
            page = (await r.json())["kv_cache"]["page_size"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == (usage["prompt_tokens"] - 1) // page * page > 0
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] <= cached


async def test_completions_stream_and_not(stack):
    body = dict(prompt="The capital of France is", temperature=0, max_tokens=12)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=body) as r:
            whole = await r.json()
    chunks, done = await _stream(stack.url, "/v1/completions", **body)
    assert done
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert "Paris" in whole["choices"][0]["text"]
    assert whole["object"] == "text_completion"


async def test_openai_client_streaming_and_not(stack):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=stack.url + "/v1", api_key="none")
    models = await client.models.list()
    model = models.data[0].id
    resp = await client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                max_tokens=32)
    assert "Paris" in resp.choices[0].message.content
    stream = await client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                  max_tokens=32, stream=True)
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert "".join(parts) == resp.choices[0].message.content
    comp = await client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=6,
                                           temperature=0)
    assert comp.choices[0].text.strip().startswith("4")
    await client.close()


async def test_generate_native_route(stack):
    async with aiohttp.ClientSession() as http:
        body = {"text": "The capital of France is",
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        async with http.post(f"{stack.url}/generate", json=body) as r:
            out = await r.json()
    assert "Paris" in out["text"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"]) <= 8
    assert meta["finish_reason"]["type"] in ("stop", "length")
    chunks, done = await _stream(stack.url, "/generate", **body)
    assert chunks[-1]["text"] == out["text"]  # SGLang streams the cumulative text


async def test_concurrent_requests_match_one_at_a_time(stack):
    prompts = [f"Count from {i}:" for i in range(6)]

    async def one(p):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{stack.url}/v1/completions",
                                 json={"prompt": p, "max_tokens": 16, "temperature": 0}) as r:
                return (await r.json())["choices"][0]["text"]

    alone = [await one(p) for p in prompts]
    together = await asyncio.gather(*(one(p) for p in prompts))
    assert list(together) == alone


async def test_health_and_models(stack):
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{stack.url}/health") as r:
            assert r.status == 200
        async with http.get(f"{stack.url}/v1/models") as r:
            data = (await r.json())["data"]
    assert data[0]["id"] == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize("stop,spans", [("answer is", 2), ("201", 3)])
async def test_stop_string_spanning_tokens_never_reaches_the_client(stack, smol_path, stop,
                                                                    spans):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smol_path / "tokenizer.json"))
    body = dict(prompt="The capital of France is", temperature=0, max_tokens=40)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=body) as r:
            free = (await r.json())["choices"][0]["text"]
        assert stop in free  # the model says it when not stopped
        ids = tok.encode(free).ids
        pieces = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
        start = next(i for i, p in enumerate(pieces) if stop in p)
        first = max(i for i in range(start) if len(pieces[i]) <= free.index(stop))
        assert start - first >= spans  # the stop string spans that many tokens
        async with http.post(f"{stack.url}/v1/completions", json={**body, "stop": [stop]}) as r:
            whole = (await r.json())["choices"][0]
    chunks, done = await _stream(stack.url, "/v1/completions", **body, stop=[stop])
    streamed = ""
    for c in chunks:
        streamed += c["choices"][0]["text"]
        assert stop not in streamed
    assert streamed == whole["text"] == free[: free.index(stop)]
    assert whole["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_min_tokens_past_an_early_stop_string_offline_text_equals_the_server(stack):
    """min_tokens keeps generating past an occurrence of the stop string that comes before the
    minimum: the request stops at a later one, in the server and in the offline Engine alike."""
    from tokenline import Engine

    engine = Engine(None, max_total_tokens=2048)
    prompt = engine.tokenizer.encode("The capital of France is").ids
    greedy = dict(temperature=0.0, max_new_tokens=40)
    free = engine.generate([prompt], greedy, use_tqdm=False)[0]
    ids, min_tokens = free.token_ids, 8
    before_min = engine.tokenizer.decode(ids[: min_tokens - 1])  # tokens that cannot stop it
    stop = next(c for c in before_min if not c.isspace() and c in free.text[len(before_min):])
    want = free.text[: free.text.index(stop, len(before_min))]
    assert stop in want  # the early occurrence stays in the text
    body = dict(prompt=prompt, temperature=0, max_tokens=40, min_tokens=min_tokens, stop=[stop])
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{stack.url}/v1/completions", json=body) as r:
            server = (await r.json())["choices"][0]
    offline = engine.generate([prompt], {**greedy, "min_tokens": min_tokens, "stop": [stop]},
                              use_tqdm=False)[0]
    assert server["finish_reason"] == offline.finish_reason == "stop"
    assert server["text"] == offline.text == want


async def test_n_choices_count_the_prompt_once_and_differ_reproducibly(stack):
    body = dict(messages=[{"role": "user", "content": "Say a random word."}], temperature=1.0,
                max_tokens=8, n=4, seed=7)
    out = await _chat(stack.url, **body)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1, 2, 3]
    texts = [c["message"]["content"] for c in sorted(out["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) == 4, texts  # distinct choices, not one sample four times
    single = await _chat(stack.url, **{**body, "n": 1})
    assert out["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] >= 4
    again = await _chat(stack.url, **body)
    assert [c["message"]["content"] for c in sorted(again["choices"],
                                                     key=lambda c: c["index"])] == texts
    other = await _chat(stack.url, **{**body, "seed": 8})
    assert [c["message"]["content"] for c in sorted(other["choices"],
                                                     key=lambda c: c["index"])] != texts


async def test_resent_conversation_reports_cached_tokens(stack):
    body = dict(messages=[{"role": "system", "content": "You are terse. " * 20},
                          {"role": "user", "content": "Hello"}], temperature=0, max_tokens=4)
    await _chat(stack.url, **body)
    second = await _chat(stack.url, **body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


async def test_chat_logprobs_over_http(stack):
    out = await _chat(stack.url, messages=QUESTION, temperature=0, max_tokens=5, logprobs=True,
                      top_logprobs=3)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]  # greedy: the top one


def test_plan_url_reads_the_running_servers_pool(stack, smol_path):
    """`tokenline plan --url` against a real server: its predicted KV bytes per token (from
    the model's config) equal the pool's, and the implied capacity the pool's size."""
    import subprocess
    import sys
    from pathlib import Path

    import requests

    info = requests.get(f"{stack.url}/get_server_info", timeout=30).json()
    cfg = json.loads((smol_path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert info["kv_cache"]["dtype"] == "float32"  # CPU: a float32 pool
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert info["kv_cache"]["bytes"] == per_token * info["kv_cache"]["num_tokens"]
    cmd = [str(Path(sys.executable).with_name("tokenline")), "plan", "--url", stack.url]
    done = subprocess.run([*cmd, "--model", str(smol_path), "--json"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    check = json.loads(done.stdout)["server"]["check"]
    assert check["predicted_kv_bytes_per_token"] == per_token
    assert check["server_kv_bytes_per_token"] == per_token and check["matches"]
    assert check["implied_token_capacity"] == info["kv_cache"]["num_tokens"]
    text = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert text.returncode == 0, text.stderr
    assert f"predicted {per_token:,} B, server {per_token:,.1f} B (matches)" in text.stdout
