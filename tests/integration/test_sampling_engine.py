"""Sampling through the engine: logprobs equal transformers', and a seeded request's text
does not depend on its neighbours, on chunking or on retraction."""

from __future__ import annotations

import random

import torch

from common.messages import SamplingParams, TokenizedReq
from services.scheduler.engine import EngineCore
from tests.helpers import engine_args, run_engine


def test_greedy_logprobs_match_transformers_log_softmax(smol_path):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(smol_path / "tokenizer.json"))
    prompt = tok.encode("The three primary colors are").ids
    engine = EngineCore(engine_args(smol_path))
    req = TokenizedReq(rid="lp", gateway_id="g", input_ids=prompt,
                       params=SamplingParams(max_new_tokens=12, temperature=0.0, logprobs=3,
                                             ignore_eos=True))
    engine.submit(req)
    logprobs = []
    while engine.has_work():
        for o in engine.step():
            logprobs += o.logprobs or []
    tokens = [lp.token_id for lp in logprobs]
    model = AutoModelForCausalLM.from_pretrained(str(smol_path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    for i, lp in enumerate(logprobs):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[lp.token_id].item()) < 1e-4
        assert lp.token_id == int(row.argmax())
        top_ids = [t for t, _ in lp.top]
        assert top_ids == row.topk(3).indices.tolist()
        assert max(abs(v - row[t].item()) for t, v in lp.top) < 1e-4


def _seeded(rid="seeded"):
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=list(range(3000, 3020)),
                        params=SamplingParams(max_new_tokens=48, temperature=1.0, seed=1234,
                                              top_p=0.95, ignore_eos=True))


def _crowd(n=31, seed=0):
    rng = random.Random(seed)
    return [TokenizedReq(rid=f"c{i}", gateway_id="g",
                         input_ids=[rng.randrange(1000, 40000) for _ in range(rng.randint(5, 60))],
                         params=SamplingParams(max_new_tokens=rng.randint(20, 60),
                                               temperature=rng.choice([0.0, 0.8, 1.2]),
                                               ignore_eos=True)) for i in range(n)]


def test_seeded_request_is_identical_alone_in_a_crowd_and_through_retraction(tiny_model_dir):
    alone, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)), [_seeded()])
    crowd_engine = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=7))
    crowd, _, _ = run_engine(crowd_engine, _crowd() + [_seeded()])
    tight = EngineCore(engine_args(tiny_model_dir, max_total_tokens=480, page_size=8,
                                   schedule_conservativeness=0.0, retraction_policy="length"))
    retracted, _, _ = run_engine(tight, _crowd() + [_seeded()])
    assert tight.scheduler.num_retractions_total > 0
    assert len(alone["seeded"]) == 48
    assert crowd["seeded"] == alone["seeded"]
    assert retracted["seeded"] == alone["seeded"]
    # and a different seed gives a different text
    other = _seeded("other")
    other.params.seed = 99
    diff, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)), [other])
    assert diff["other"] != alone["seeded"]


def test_seeded_request_resumed_from_its_streamed_tokens_continues_identically(tiny_model_dir):
    full, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)), [_seeded()])
    resumed = _seeded()
    resumed.output_ids = full["seeded"][:20]  # as a gateway does after losing a scheduler
    rest, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)), [resumed])
    assert full["seeded"][:20] + rest["seeded"] == full["seeded"]


def test_min_tokens_holds_off_eos_and_stop_token_ids(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir))
    first, _, _ = run_engine(engine, [TokenizedReq(
        rid="probe", gateway_id="g", input_ids=[5, 6, 7],
        params=SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True))])
    stop_tok = first["probe"][2]
    req = TokenizedReq(rid="m", gateway_id="g", input_ids=[5, 6, 7],
                       params=SamplingParams(max_new_tokens=10, temperature=0.0,
                                             stop_token_ids=[stop_tok]))
    early, fin, _ = run_engine(engine, [req])
    assert fin["m"].kind == "stop" and fin["m"].matched == stop_tok
    assert early["m"][-1] == stop_tok and len(early["m"]) <= 3
    req2 = TokenizedReq(rid="m2", gateway_id="g", input_ids=[5, 6, 7],
                        params=SamplingParams(max_new_tokens=10, temperature=0.0,
                                              stop_token_ids=[stop_tok], min_new_tokens=6))
    late, _, _ = run_engine(engine, [req2])
    assert len(late["m2"]) >= 6 and stop_tok not in late["m2"][:5]
