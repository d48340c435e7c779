"""The engine under memory pressure: retraction keeps greedy output exact, chunked prefill
keeps other requests decoding, and a request that can never fit gets a clear error."""

from __future__ import annotations

import random

import pytest

from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from tests.helpers import engine_args, run_engine


def _workload(n=32, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(8, 40))]
        params = SamplingParams(max_new_tokens=rng.randint(24, 64), temperature=0.0,
                                ignore_eos=True)
        reqs.append(TokenizedReq(rid=f"r{i}", gateway_id="g", input_ids=prompt, params=params,
                                 priority=i % 3))
    return reqs


@pytest.fixture(scope="module")
def ample(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=16384))
    tokens, _, _ = run_engine(engine, _workload())
    assert engine.scheduler.num_retractions_total == 0
    return tokens


@pytest.mark.parametrize("policy", ["length", "priority"])
def test_retraction_keeps_greedy_tokens_exact(tiny_model_dir, ample, policy):
    # conservativeness 0: admit whatever fits now, so the pool runs out while decoding
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=640, page_size=8,
                                    retraction_policy=policy, schedule_conservativeness=0.0,
                                    debug_check_integrity=True))
    tokens, finish, _ = run_engine(engine, _workload())
    assert engine.scheduler.num_retractions_total >= 5
    assert tokens == ample
    assert all(f.kind == "length" for f in finish.values())
    engine.check_integrity()
    assert engine.pool.num_used == 0


def _running_scheduler(policy: str) -> tuple[Scheduler, list[Request]]:
    pool = BlockPool(num_blocks=6, page_size=4, enable_prefix_cache=False)
    sched = Scheduler(SchedulerConfig(retraction_policy=policy, max_prefill_tokens=64,
                                      conservativeness=0.0,
                                      chunked_prefill_size=64), pool)
    reqs = []
    for prio in (2, 0, 1):
        r = Request(rid=f"p{prio}", prompt_ids=[1] * 7, priority=prio,
                    params=SamplingParams(max_new_tokens=50))
        sched.add(r)
        reqs.append(r)
    batch = sched.schedule()
    sched.advance(batch)
    for r, generated in zip(reqs, (1, 3, 2), strict=True):
        r.output_ids += [5] * generated
    return sched, reqs


def test_priority_policy_retracts_lowest_priority_first():
    sched, reqs = _running_scheduler("priority")
    batch = sched.schedule()  # each needs a 3rd block; only 0 left: someone must go
    assert [r.rid for r in batch.retracted][:1] == ["p0"]


def test_length_policy_retracts_fewest_generated_first():
    sched, reqs = _running_scheduler("length")
    batch: ScheduledBatch = sched.schedule()
    assert [r.rid for r in batch.retracted][:1] == ["p2"]  # generated 1 token


def test_long_prompt_chunked_matches_unchunked_and_others_keep_decoding(tiny_model_dir):
    rng = random.Random(1)
    long_prompt = [rng.randrange(1000, 40000) for _ in range(1500)]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    whole = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=2048,
                                   max_prefill_tokens=2048))
    ref, _, _ = run_engine(whole, [TokenizedReq(rid="long", gateway_id="g",
                                                input_ids=long_prompt, params=params)])

    engine = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=128,
                                    max_prefill_tokens=128))
    short = TokenizedReq(rid="short", gateway_id="g", input_ids=[5, 6, 7],
                         params=SamplingParams(max_new_tokens=40, temperature=0.0,
                                               ignore_eos=True))
    engine.submit(short)
    engine.step()  # the short request is running (prefilled, first token out)
    engine.submit(TokenizedReq(rid="long", gateway_id="g", input_ids=long_prompt, params=params))
    got: list[int] = []
    prefill_steps = 0
    while engine.has_work():
        outs = {o.rid: o for o in engine.step()}
        step = engine.last_step
        if step.num_prefill_tokens:
            prefill_steps += 1
            assert step.num_prefill_tokens <= 128
            # while the long prompt prefills, the short request gets a token at every step
            if "short" in engine.requests:
                assert "short" in step.scheduled_rids and outs["short"].token_ids
        if "long" in outs:
            got += outs["long"].token_ids
    assert prefill_steps >= 1500 // 128
    assert got == ref["long"]


def test_request_larger_than_the_pool_gets_a_clear_error(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=64, page_size=16))
    big = TokenizedReq(rid="big", gateway_id="g", input_ids=list(range(1000, 1100)),
                       params=SamplingParams(max_new_tokens=4, temperature=0.0))
    ok = TokenizedReq(rid="ok", gateway_id="g", input_ids=[5, 6, 7],
                      params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    tokens, finish, _ = run_engine(engine, [big, ok], max_steps=100)
    assert finish["big"].kind == "error" and "KV cache" in finish["big"].message
    assert finish["ok"].kind == "length" and len(tokens["ok"]) == 4
    engine.check_integrity()


def test_decode_outgrowing_the_pool_alone_ends_with_an_error_not_a_hang(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=32, page_size=8))
    req = TokenizedReq(rid="grow", gateway_id="g", input_ids=[5] * 10,
                       params=SamplingParams(max_new_tokens=100, temperature=0.0,
                                             ignore_eos=True))
    tokens, finish, steps = run_engine(engine, [req], max_steps=200)
    assert finish["grow"].kind == "error"
    assert len(tokens["grow"]) == 32 - 10 + 1  # ran until the pool was full (the last token
    # sampled needs no KV yet)
    engine.check_integrity()
