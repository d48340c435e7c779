"""Aborts at the engine: blocks come back at the next step boundary; an abort that overtakes
its request wins, and nothing is ever allocated for it."""

from __future__ import annotations

from common.messages import AbortReq, SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from tests.helpers import engine_args

PARAMS = SamplingParams(max_new_tokens=500, temperature=0.0, ignore_eos=True)


def _req(rid, n=40):
    return TokenizedReq(rid=rid, gateway_id="g", input_ids=list(range(1000, 1000 + n)),
                        params=PARAMS)


def test_abort_running_and_waiting_requests_frees_their_blocks(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=4096,
                                    max_running_requests=2, disable_prefix_cache=True))
    for rid in ("a", "b", "c"):
        engine.submit(_req(rid))
    for _ in range(5):
        engine.step()
    assert engine.pool.num_used > 0 and len(engine.scheduler.waiting) == 1
    a_blocks = list(engine.requests["a"].block_table)
    assert a_blocks
    engine.abort(AbortReq(rid="a"))
    engine.abort(AbortReq(rid="c"))  # still waiting
    outs = engine.step()
    ended = {o.rid: o.finish.kind for o in outs if o.finish}
    assert ended == {"a": "abort", "c": "abort"}
    assert {r.rid for r in engine.scheduler.running} == {"b"}
    assert len(engine.requests) == 1
    # at this step boundary a's blocks are back: only b's are in use
    assert all(engine.pool.ref_cnt[blk] == 0 for blk in a_blocks)
    assert engine.pool.num_used == len(engine.requests["b"].block_table)
    engine.check_integrity()
    engine.abort(AbortReq(abort_all=True))
    outs = engine.step()
    assert [(o.rid, o.finish.kind) for o in outs if o.finish] == [("b", "abort")]
    assert engine.pool.num_used == 0 and not engine.requests
    engine.check_integrity()
    assert engine.num_aborted_total == 3


def test_abort_that_arrives_first_wins_and_allocates_nothing(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=4096))
    allocations = []
    real_allocate = engine.pool.allocate
    engine.pool.allocate = lambda n: allocations.append(n) or real_allocate(n)
    engine.abort(AbortReq(rid="early"))
    engine.step()  # the tokenizer is still busy: the abort is remembered
    engine.submit(_req("early"))
    outs = engine.step()
    assert [o.finish.kind for o in outs if o.rid == "early"] == ["abort"]
    assert allocations == [] and not engine.scheduler.has_work()
    assert not engine.requests
    engine.submit(_req("later"))
    engine.step()
    assert allocations  # an ordinary request still allocates
