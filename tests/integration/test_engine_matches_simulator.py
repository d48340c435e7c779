"""`tokenline simulate` on a real engine run: the continuous policy's makespan equals the
engine's step count when every prompt fits in one step's prefill (one step per decode token,
the first token coming out of the prefill step)."""

from __future__ import annotations

import random

import pytest

from bench.simulate import simulate
from common.messages import SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args, run_engine


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("max_batch", [4, 8])
def test_engine_steps_equal_simulated_makespan(tiny_model_dir, max_batch, policy):
    rng = random.Random(max_batch)
    lengths = [rng.randint(1, 20) for _ in range(16)]
    reqs = [TokenizedReq(rid=f"r{i}", gateway_id="g", input_ids=[1000 + i] * 8,
                         params=SamplingParams(max_new_tokens=n, temperature=0.0,
                                               ignore_eos=True))
            for i, n in enumerate(lengths)]
    engine = EngineCore(engine_args(tiny_model_dir, max_running_requests=max_batch,
                                    batching=policy, disable_prefix_cache=True))
    tokens, _, steps = run_engine(engine, reqs)
    assert [len(tokens[f"r{i}"]) for i in range(16)] == lengths
    sim = simulate(policy, max_batch, lengths)
    assert steps == sim.makespan


def test_chunked_prefill_adds_the_extra_prefill_steps(tiny_model_dir):
    # A 40-token prompt in chunks of 16 needs 3 steps before its first token: 2 more than the
    # simulator's model, which gives every prompt one step.
    req = TokenizedReq(rid="c", gateway_id="g", input_ids=list(range(1000, 1040)),
                       params=SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True))
    engine = EngineCore(engine_args(tiny_model_dir, chunked_prefill_size=16,
                                    max_prefill_tokens=16))
    _, _, steps = run_engine(engine, [req])
    assert steps == simulate("continuous", 1, [5]).makespan + 2
