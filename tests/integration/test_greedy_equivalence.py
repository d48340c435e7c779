"""Greedy tokens equal transformers' generate, alone or in a batch of many (real SmolLM2)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args, run_engine

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
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompt_ids(smol_path):
    tok = Tokenizer.from_file(str(smol_path / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(smol_path, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()
    out = []
    for ids in prompt_ids:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        new = gen[0, len(ids):].tolist()
        if 2 in new:  # generate pads after EOS (id 2); we stop there too
            new = new[: new.index(2) + 1]
        out.append(new)
    return out


def _reqs(prompt_ids, tag=""):
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0)
    return [TokenizedReq(rid=f"{tag}{i}", gateway_id="g", input_ids=ids, params=params)
            for i, ids in enumerate(prompt_ids)]


@pytest.fixture(scope="module")
def engine(smol_path):
    return EngineCore(engine_args(smol_path, max_total_tokens=16384, debug_check_integrity=True))


def test_concurrent_greedy_equals_transformers_generate(engine, prompt_ids, reference):
    tokens, finish, _ = run_engine(engine, _reqs(prompt_ids))
    for i, ref in enumerate(reference):
        assert tokens[str(i)] == ref, f"prompt {i} differs from transformers"
        assert finish[str(i)].kind == ("length" if len(ref) == NEW_TOKENS else "stop")
    engine.check_integrity()


def test_one_at_a_time_equals_concurrent(engine, prompt_ids, reference):
    for i, req in enumerate(_reqs(prompt_ids, tag="solo")):
        tokens, _, _ = run_engine(engine, [req])
        assert tokens[req.rid] == reference[i]
    engine.check_integrity()


def test_chunked_prefill_and_tiny_pages_give_the_same_tokens(smol_path, prompt_ids, reference):
    engine = EngineCore(engine_args(smol_path, max_total_tokens=4096, page_size=4,
                                    chunked_prefill_size=5, max_prefill_tokens=9,
                                    disable_prefix_cache=True))
    tokens, _, _ = run_engine(engine, _reqs(prompt_ids))
    for i, ref in enumerate(reference):
        assert tokens[str(i)] == ref
