"""Sampling through the engine: logprobs equal transformers', and a seeded request's text
does not depend on its neighbours, on chunking or on retraction."""

from __future__ import annotations

import json
import random
import shutil

import torch

from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
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


def _run_watching_retractions(engine: EngineCore, reqs: list[TokenizedReq], rid: str):
    """Tokens per request, `rid`'s own retraction count (from its outputs) and how many of its
    tokens had been streamed when each of its retractions happened."""
    for r in reqs:
        engine.submit(r)
    tokens: dict[str, list[int]] = {r.rid: [] for r in reqs}
    retractions, streamed_at = 0, []
    while engine.has_work():
        outs = engine.step()
        if rid in engine.last_step.retracted_rids:
            streamed_at.append(len(tokens[rid]))
        for o in outs:
            tokens[o.rid] += o.token_ids
            if o.rid == rid:
                retractions = o.retractions
    return tokens, retractions, streamed_at


def test_seeded_request_is_identical_alone_in_a_crowd_and_through_retraction(tiny_model_dir):
    alone, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)), [_seeded()])
    crowd_engine = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=7))
    crowd, _, _ = run_engine(crowd_engine, _crowd() + [_seeded()])
    # a tight pool, and the seeded request is the first victim (lowest priority)
    tight = EngineCore(engine_args(tiny_model_dir, max_total_tokens=480, page_size=8,
                                   schedule_conservativeness=0.0, retraction_policy="priority"))
    victim = _seeded()
    victim.priority = -1
    retracted, retractions, streamed_at = _run_watching_retractions(
        tight, _crowd() + [victim], "seeded")
    assert retractions >= 1 and len(streamed_at) == retractions
    assert max(streamed_at) > 0  # retracted mid-stream, not only before its first token
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


MIN_NEW = 6


def _greedy(rid: str, **params) -> TokenizedReq:
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=[5, 6, 7],
                        params=SamplingParams(max_new_tokens=12, temperature=0.0, **params))


def test_min_tokens_holds_off_eos_and_stop_token_ids(tiny_model_dir, tmp_path):
    probe, _, _ = run_engine(EngineCore(engine_args(tiny_model_dir)),
                             [_greedy("probe", ignore_eos=True)])
    free = probe["probe"]
    # two tokens greedy decoding says early: one becomes the model's EOS, one a stop token id
    eos_tok, stop_tok = free[1], next(t for t in free[2:] if t != free[1])
    assert free.index(stop_tok) < MIN_NEW
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_tok]}))
    engine = EngineCore(engine_args(model))
    assert eos_tok in engine.eos_ids

    early, fin, _ = run_engine(engine, [_greedy("eos"), _greedy("stop", ignore_eos=True,
                                                                  stop_token_ids=[stop_tok])])
    assert early["eos"] == free[:2] and fin["eos"].kind == "stop" and fin["eos"].matched is None
    at = free.index(stop_tok) + 1
    assert early["stop"] == free[:at] and fin["stop"].matched == stop_tok

    held, fin, _ = run_engine(engine, [
        _greedy("eos", min_new_tokens=MIN_NEW),
        _greedy("stop", ignore_eos=True, stop_token_ids=[stop_tok], min_new_tokens=MIN_NEW),
        _greedy("both", stop_token_ids=[stop_tok], min_new_tokens=MIN_NEW)])
    assert eos_tok not in held["eos"][:MIN_NEW] and stop_tok not in held["stop"][:MIN_NEW]
    assert not {eos_tok, stop_tok} & set(held["both"][:MIN_NEW])
    for rid, out in held.items():  # past the hold-off they stop on the same tokens as ever
        assert len(out) > MIN_NEW, rid
        assert fin[rid].kind == "length" or out[-1] in (eos_tok, stop_tok), rid
