"""`tokenline serve --speculative-algorithm NGRAM` over HTTP: the text is the text without
speculation (greedy and seeded, n > 1, logprobs, a stop string), the counters reach /metrics
and the acceptance rate /get_server_info, and the books balance.

One stack of the tiny random Llama for the module; the reference runs the offline engine
without speculation in this process.
"""

from __future__ import annotations

import time

import openai
import pytest
import requests

from tests.e2e.reliability import assert_books_balance, metrics, tiny_stack
from tests.helpers import metric

pytestmark = [pytest.mark.timeout(300), pytest.mark.stack]

# a prompt the tiny model answers with runs of repeated tokens: drafts are proposed and kept
PROMPT = [1000 + (i % 7) for i in range(40)]


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with tiny_stack(tiny_model_dir, "--speculative-algorithm", "NGRAM",
                    "--speculative-num-draft-tokens", "3") as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from tokenline.offline import Engine

    engine = Engine(str(tiny_model_dir), max_model_len=256, max_total_tokens=16384)

    def run(**params):
        n = params.pop("n", 1)
        seed = params.pop("seed", None)
        outs = []
        for j in range(n):
            p = dict(params, seed=seed + j if seed is not None else None)
            outs.append(engine.generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)[0])
        return outs

    return run


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="none", max_retries=0)


def test_greedy_stream_with_logprobs_is_the_text_without_speculation(client, reference):
    want = reference(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=2)[0]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=48,
                                       temperature=0, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    text, tokens = "", []
    for chunk in stream:
        text += chunk.choices[0].text
        tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert text == want.text
    assert len(tokens) == 48


def test_a_stop_string_and_n_seeded_choices(client, reference):
    full = reference(max_tokens=40, temperature=0.0, ignore_eos=True)[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = reference(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    wants = reference(max_tokens=32, temperature=1.0, seed=5, n=2, ignore_eos=True)
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=1,
                                    seed=5, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [
        w.text for w in wants]


def test_acceptance_reaches_metrics_and_server_info(stack, client):
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0)
    text = metrics(stack.url)
    drafts = metric(text, "tokenline:spec_decode_num_draft_tokens_total", model_name="tiny")
    accepted = metric(text, "tokenline:spec_decode_num_accepted_tokens_total",
                      model_name="tiny")
    first = metric(text, "tokenline:spec_decode_num_accepted_tokens_per_pos_total",
                   model_name="tiny", position="0")
    assert metric(text, "tokenline:spec_decode_num_drafts_total", model_name="tiny") > 0
    assert 0 < accepted <= drafts and 0 < first <= accepted
    spec = _server_info_after_a_heartbeat(stack.url)
    assert spec["algorithm"] == "NGRAM" and spec["num_draft_tokens"] == 3
    assert 0 < spec["acceptance_rate"] <= 1


def _server_info_after_a_heartbeat(url: str) -> dict:
    """The scheduler's speculative settings and acceptance once a heartbeat carried some."""
    deadline = time.monotonic() + 10
    while True:
        spec = requests.get(url + "/get_server_info", timeout=10).json()["speculative"]
        if spec["acceptance_rate"] > 0 or time.monotonic() > deadline:
            return spec
        time.sleep(0.1)


def test_books_balance(stack):
    assert_books_balance(stack.url)


def test_bench_serve_reports_the_acceptance_rate(stack):
    import asyncio

    from bench.datasets import SampleRequest
    from bench.serve import format_result, run_benchmark

    reqs = [SampleRequest(prompt=PROMPT, prompt_len=len(PROMPT), max_tokens=24)] * 2
    result = asyncio.run(run_benchmark(stack.url, reqs, ignore_eos=True))
    assert result["completed"] == 2
    assert result["spec_draft_tokens"] > 0
    assert 0 < result["spec_acceptance_rate"] <= 1
    assert "Draft acceptance rate:" in format_result(result)


def test_a_draft_model_serves_the_same_text(tiny_model_dir, reference):
    """`--speculative-algorithm STANDALONE`: the scheduler loads the draft beside the target."""
    want = reference(max_tokens=32, temperature=0.0, ignore_eos=True)[0]
    with tiny_stack(tiny_model_dir, "--speculative-algorithm", "STANDALONE",
                    "--speculative-draft-model-path", str(tiny_model_dir)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
        info = _server_info_after_a_heartbeat(s.url)
        assert info["algorithm"] == "STANDALONE" and info["acceptance_rate"] == 1.0
        assert_books_balance(s.url)
