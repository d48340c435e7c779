"""Prompt logprobs from the prefill forward equal transformers' log-softmax of the same model
(SmolLM2, float32), over chunked prefill, with the prefix cache warm, and through retraction."""

from __future__ import annotations

import random

import pytest
import torch
from tokenizers import Tokenizer

from common.messages import LogprobOut, SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined a screw press, movable metal type and an oil-based ink. Books "
        "became cheaper, literacy spread across Europe, and the ideas of scholars travelled "
        "faster than ever before. Within fifty years, presses were running in more than two "
        "hundred cities, printing bibles, grammars, calendars and pamphlets by the million.")
CHUNK = 32  # the prompt is longer than this: its logprobs come from several prefill chunks
TOP = 5


@pytest.fixture(scope="module")
def prompt(smol_path) -> list[int]:
    ids = Tokenizer.from_file(str(smol_path / "tokenizer.json")).encode(TEXT).ids
    assert len(ids) > 2 * CHUNK
    return ids


@pytest.fixture(scope="module")
def reference(smol_path, prompt) -> torch.Tensor:
    """transformers' log-softmax of every position: row j is token j + 1's distribution."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)


@pytest.fixture(scope="module")
def engine(smol_path):
    return EngineCore(engine_args(smol_path, dtype="float32", max_total_tokens=4096,
                                  chunked_prefill_size=CHUNK, max_prefill_tokens=CHUNK,
                                  debug_check_integrity=True))


def run(engine: EngineCore, reqs: list[TokenizedReq]) -> dict[str, dict]:
    """Drive the engine until idle: per rid its tokens, finish, cached tokens and every
    prompt_logprobs list it sent (there must be exactly one)."""
    got = {r.rid: {"tokens": [], "prompt": [], "cached": 0} for r in reqs}
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        for out in engine.step():
            g = got[out.rid]
            g["tokens"] += out.token_ids
            g["cached"] = out.cached_tokens
            if out.prompt_logprobs is not None:
                g["prompt"].append(out.prompt_logprobs)
            if out.finish is not None:
                g["finish"] = out.finish
    engine.check_integrity()
    return got


def req(rid: str, ids: list[int], **params) -> TokenizedReq:
    params.setdefault("temperature", 0.0)
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=ids, params=SamplingParams(**params))


def assert_matches(lps: list[LogprobOut], prompt: list[int], ref: torch.Tensor) -> None:
    assert [lp.token_id for lp in lps] == prompt
    for j, lp in enumerate(lps[1:], 1):
        row = ref[j - 1]
        assert lp.logprob == pytest.approx(row[prompt[j]].item(), abs=2e-3), j
        # its rank among the reference's, up to near-ties
        assert (row > lp.logprob + 2e-3).sum() + 1 <= lp.rank <= (row > lp.logprob - 2e-3).sum() + 1
        top_v = [v for _, v in lp.top]
        assert top_v == pytest.approx(row.topk(TOP).values.tolist(), abs=2e-3), j
        assert all(row[t].item() == pytest.approx(v, abs=2e-3) for t, v in lp.top)


def test_prompt_logprobs_over_chunks_equal_transformers(engine, prompt, reference):
    got = run(engine, [req("a", prompt, max_new_tokens=3, prompt_logprobs=TOP)])["a"]
    assert len(got["prompt"]) == 1, "prompt logprobs are sent exactly once"
    assert_matches(got["prompt"][0], prompt, reference)
    assert got["tokens"] == [reference[-1].argmax().item()] + got["tokens"][1:]


def test_warm_prefix_cache_is_bypassed_and_still_filled(engine, prompt, reference):
    engine.pool.flush()
    run(engine, [req("warm", prompt, max_new_tokens=1)])
    got = run(engine, [req("b", prompt, max_new_tokens=1, prompt_logprobs=TOP)])["b"]
    assert got["cached"] == 0  # computed from token 0: a cached prefix has no logits
    assert_matches(got["prompt"][0], prompt, reference)
    plain = run(engine, [req("c", prompt, max_new_tokens=1)])["c"]
    assert plain["cached"] > 0 and got["tokens"] == plain["tokens"]


def test_max_tokens_zero_ends_after_the_prompt(engine, prompt, reference):
    got = run(engine, [req("z", prompt, max_new_tokens=0, prompt_logprobs=0)])["z"]
    assert got["tokens"] == [] and got["finish"].kind == "length"
    assert [lp.top for lp in got["prompt"][0]] == [[]] * len(prompt)
    assert got["prompt"][0][5].logprob == pytest.approx(reference[4][prompt[5]].item(),
                                                        abs=2e-3)


def test_requests_that_do_not_ask_get_none(engine, prompt):
    got = run(engine, [req("n", prompt, max_new_tokens=2, logprobs=1)])["n"]
    assert got["prompt"] == [] and len(got["tokens"]) == 2


def _workload(n: int = 12, seed: int = 0) -> list[TokenizedReq]:
    rng = random.Random(seed)
    return [req(f"r{i}", [rng.randrange(1000, 40000) for _ in range(rng.randint(20, 60))],
                max_new_tokens=rng.randint(16, 40), ignore_eos=True, prompt_logprobs=2)
            for i in range(n)]


def test_retraction_neither_duplicates_nor_loses_prompt_logprobs(tiny_model_dir):
    ample = run(EngineCore(engine_args(tiny_model_dir, max_total_tokens=16384,
                                       chunked_prefill_size=16)), _workload())
    tight = EngineCore(engine_args(tiny_model_dir, max_total_tokens=480, page_size=8,
                                   chunked_prefill_size=16, schedule_conservativeness=0.0,
                                   debug_check_integrity=True))
    got = run(tight, _workload())
    assert tight.scheduler.num_retractions_total >= 3
    for rid, g in got.items():
        assert len(g["prompt"]) == 1, rid
        ours, theirs = g["prompt"][0], ample[rid]["prompt"][0]
        assert [lp.token_id for lp in ours] == [lp.token_id for lp in theirs]
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs],
                                                            abs=1e-4)
        assert g["tokens"] == ample[rid]["tokens"]
