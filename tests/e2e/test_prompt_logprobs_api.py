"""Prompt logprobs over HTTP, through one stack of the real SmolLM2 (float32): OpenAI's `echo`
with `logprobs` (and `max_tokens: 0`), vLLM's `prompt_logprobs` on both completion routes,
SGLang's `logprob_start_len`, the 400s naming their field, and lm-evaluation-harness scoring
a hand-written multiple-choice task through `local-completions` to transformers' numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest
import torch
from tokenizers import Tokenizer

from common.modelstore import model_info
from tests.helpers import Stack

TEXT = "The quick brown fox jumps over the lazy dog, and the cat watches it from the wall."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
LM_EVAL = Path(__file__).resolve().parents[2] / ".venv-clients" / "lm-eval" / "bin" / "lm_eval"
ITEMS = [  # a hand-written multiple-choice task: no data set to download
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"],
     "answer": 0},
    {"question": "Two plus two equals", "choices": ["three", "four", "five"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": ["Kelvin", "Fahrenheit",
                                                            "Celsius"], "answer": 2},
    {"question": "The opposite of hot is", "choices": ["cold", "warm", "loud"], "answer": 0},
]


@pytest.fixture(scope="module")
def stack():
    with Stack() as s:
        yield s


@pytest.fixture(scope="module")
def tok(smol_path) -> Tokenizer:
    return Tokenizer.from_file(str(model_info(smol_path).tokenizer_json))


@pytest.fixture(scope="module")
def hf_model(smol_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> list[float]:
    """transformers' logprob of each token after the first, given the ones before it."""
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return [lp[j - 1, ids[j]].item() for j in range(1, len(ids))]


@pytest.fixture
def client(stack):
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)


async def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as r:
            return r.status, await r.json()


async def test_echo_with_max_tokens_zero_returns_the_prompt_and_its_logprobs(
        client, tok, hf_model):
    ids = tok.encode(TEXT).ids
    out = await client.completions.create(model="", prompt=TEXT, echo=True, logprobs=2,
                                          max_tokens=0)
    choice = out.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lps = choice.logprobs
    assert lps.tokens == [tok.decode([t]) for t in ids]
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None  # as OpenAI does
    assert lps.token_logprobs[1:] == pytest.approx(hf_logprobs(hf_model, ids), abs=2e-3)
    assert all(len(top) == 2 for top in lps.top_logprobs[1:])
    assert lps.text_offset[-1] == len(TEXT) - len(lps.tokens[-1])


async def test_echo_puts_the_prompt_logprobs_before_the_generated_ones(client, tok):
    ids = tok.encode(TEXT).ids
    out = await client.completions.create(model="", prompt=ids, echo=True, logprobs=1,
                                          max_tokens=3, temperature=0)
    lps = out.choices[0].logprobs
    assert len(lps.tokens) == len(lps.token_logprobs) == len(ids) + 3
    assert out.choices[0].text.startswith(TEXT)
    generated = await client.completions.create(model="", prompt=ids, logprobs=1,
                                                max_tokens=3, temperature=0)
    assert lps.token_logprobs[len(ids):] == pytest.approx(
        generated.choices[0].logprobs.token_logprobs, abs=1e-4)


async def test_echo_streams_the_prompt_and_its_logprobs_first(client, tok):
    ids = tok.encode(TEXT).ids
    stream = await client.completions.create(model="", prompt=TEXT, echo=True, logprobs=0,
                                             max_tokens=2, temperature=0, stream=True)
    chunks = [c async for c in stream]
    first = chunks[0].choices[0]
    assert first.text.startswith(TEXT)
    assert first.logprobs.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert first.logprobs.token_logprobs[0] is None


async def test_vllm_prompt_logprobs_on_completions_and_chat(client, stack, tok, hf_model):
    ids = tok.encode(TEXT).ids
    out = await client.completions.create(model="", prompt=TEXT, max_tokens=1,
                                          extra_body={"prompt_logprobs": 3})
    plp = out.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_logprobs(hf_model, ids)
    for j, entry in enumerate(plp[1:], 1):
        own = entry[str(ids[j])]
        assert own["logprob"] == pytest.approx(ref[j - 1], abs=2e-3)
        assert own["decoded_token"] == tok.decode([ids[j]]) and own["rank"] >= 1
        assert 3 <= len(entry) <= 4 and sorted(e["rank"] for e in entry.values())[:3] == [1, 2, 3]
    chat = await client.chat.completions.create(model="", messages=QUESTION, max_tokens=1,
                                                extra_body={"prompt_logprobs": 0})
    plp = chat.model_extra["prompt_logprobs"]  # vLLM's place: the response's, not a choice's
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None
    assert all(len(e) == 1 for e in plp[1:])


async def test_sglang_logprob_start_len_gives_input_token_logprobs(stack, tok):
    ids = tok.encode(TEXT).ids
    status, out = await _post(stack.url, "/generate", {
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "top_logprobs_num": 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert status == 200, out
    meta = out["meta_info"]
    assert [t for _, t in meta["input_token_logprobs"]] == ids
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    assert len(meta["input_top_logprobs"][1]) == 1


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "1"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": 99}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 0}, "max_tokens"),
    ("/generate", {"text": "x", "logprob_start_len": -2}, "logprob_start_len"),
])
async def test_bad_prompt_logprob_fields_are_400s_naming_the_field(stack, path, body, param):
    status, out = await _post(stack.url, path, body)
    assert status == 400, out
    assert out["error"]["param"] == param, out


TASK = """\
task: tiny_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def lm_eval_scores(url: str, model: str, tokenizer: Path, tmp: Path) -> list[list[float]]:
    """lm-eval's `local-completions` on the task above; each item's loglikelihoods."""
    (tmp / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ITEMS))
    (tmp / "tiny_choices.yaml").write_text(TASK.format(items=tmp / "items.jsonl"))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp / "hf")}
    subprocess.run([
        str(LM_EVAL), "--model", "local-completions", "--tasks", "tiny_choices",
        "--include_path", str(tmp), "--log_samples", "--output_path", str(tmp / "out"),
        "--model_args", f"model={model},base_url={url}/v1/completions,tokenizer={tokenizer},"
                        "tokenizer_backend=huggingface,tokenized_requests=True,max_retries=1"],
        check=True, env=env, timeout=600)
    samples = sorted((tmp / "out").rglob("samples_tiny_choices_*.jsonl"))
    assert samples, "lm-eval wrote no samples"
    rows = [json.loads(line) for line in samples[-1].read_text().splitlines()]
    rows.sort(key=lambda r: r["doc_id"])
    return [[float(r[0][0]) for r in row["resps"]] for row in rows]


def test_lm_eval_loglikelihoods_equal_transformers(stack, smol_path, tok, hf_model, tmp_path):
    assert LM_EVAL.exists(), f"{LM_EVAL} is missing: `make install` creates it"
    model = json.loads(subprocess.run(
        [sys.executable, "-c", f"import urllib.request; print(urllib.request.urlopen("
                               f"'{stack.url}/v1/models').read().decode())"],
        capture_output=True, text=True, check=True).stdout)["data"][0]["id"]
    scores = lm_eval_scores(stack.url, model, smol_path, tmp_path)
    assert len(scores) == len(ITEMS)
    for item, got in zip(ITEMS, scores, strict=True):
        want = []
        for choice in item["choices"]:
            # lm-eval's split: the context's tokens, then the rest of the whole's
            ctx = tok.encode(item["question"]).ids
            whole = tok.encode(item["question"] + " " + choice).ids
            want.append(sum(hf_logprobs(hf_model, whole)[len(ctx) - 1:]))
        assert got == pytest.approx(want, abs=5e-3), textwrap.shorten(str(item), 60)
