"""A burst of requests arriving at once (what `tokenline bench peers` sends): while it is
admitted, every decoding request still gets its token every step, prefill fills the step's
budget, shorter prompts get their first token first (sjf), and no request is overtaken forever.
"""

from __future__ import annotations

import random
import statistics

import pytest

from common.messages import Finish, SamplingParams, TokenizedReq
from services.scheduler.core.engine import EngineCore
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig
from tests.helpers import engine_args

BUDGET, CHUNK = 256, 64
# far above any step time here, so that only sjf's order is tested, not its time limit
NEVER = 3600.0


def _burst(n=24, seed=0) -> list[TokenizedReq]:
    rng = random.Random(seed)
    return [TokenizedReq(rid=f"r{i}", gateway_id="g",
                         input_ids=[rng.randrange(1000, 40000) for _ in range(rng.randint(8, 200))],
                         params=SamplingParams(max_new_tokens=rng.randint(4, 12),
                                               temperature=0.0, ignore_eos=True))
            for i in range(n)]


def _run_burst(tiny_model_dir, policy: str):
    """Submit the whole burst before the first step; check each step's batch against what the
    policy promises; return rid -> tokens and rid -> the step of its first token."""
    engine = EngineCore(engine_args(tiny_model_dir, schedule_policy=policy, sjf_max_wait=NEVER,
                                    max_prefill_tokens=BUDGET, chunked_prefill_size=CHUNK,
                                    max_total_tokens=16384, disable_prefix_cache=True))
    reqs = _burst()
    for r in reqs:
        engine.submit(r)
    prompt_left = {r.rid: len(r.input_ids) for r in reqs}
    tokens: dict[str, list[int]] = {r.rid: [] for r in reqs}
    first_step: dict[str, int] = {}
    decoding: set[str] = set()
    step = 0
    while engine.has_work():
        step += 1
        assert step < 1000, "no progress"
        # what a budget-filling step can take: one chunk of each prompt not yet computed
        can_take = sum(min(CHUNK, n) for n in prompt_left.values() if n)
        outs = engine.step()
        stats = engine.last_step
        scheduled = dict(zip(stats.scheduled_rids, stats.num_new, strict=True))
        for rid in decoding:
            assert scheduled.get(rid) == 1, f"step {step}: decoding {rid} got no token"
        prefill = 0
        for rid, n in scheduled.items():
            if prompt_left[rid]:
                assert n <= min(CHUNK, prompt_left[rid])
                prompt_left[rid] -= n
                prefill += n
        assert prefill == min(BUDGET, can_take), f"step {step}: the prefill budget not filled"
        for out in outs:
            tokens[out.rid] += out.token_ids
            if out.token_ids:
                first_step.setdefault(out.rid, step)
            if out.finish is None:
                decoding.add(out.rid)
            else:
                decoding.discard(out.rid)
    assert all(len(tokens[r.rid]) == r.params.max_new_tokens for r in reqs)
    return reqs, tokens, first_step


@pytest.fixture(scope="module")
def fcfs(tiny_model_dir):
    return _run_burst(tiny_model_dir, "fcfs")


def test_burst_decodes_every_step_and_fills_the_prefill_budget(fcfs):
    reqs, _, first_step = fcfs  # the checks are in _run_burst, at every step
    # the burst's prompts need several steps of budget: the checks above saw it being admitted
    assert sum(len(r.input_ids) for r in reqs) > 4 * BUDGET
    assert max(first_step.values()) > 4


def test_sjf_gives_shorter_prompts_their_first_token_first(tiny_model_dir, fcfs):
    reqs, tokens, first_step = _run_burst(tiny_model_dir, "sjf")
    by_len = sorted(reqs, key=lambda r: len(r.input_ids))
    steps = [first_step[r.rid] for r in by_len]
    assert steps == sorted(steps), "a longer prompt got its first token before a shorter one"
    fcfs_reqs, fcfs_tokens, fcfs_first = fcfs
    assert statistics.median(first_step.values()) < statistics.median(fcfs_first.values())
    assert tokens == fcfs_tokens  # the order changes when tokens come, never which


def _prefill_request(rid: str, n: int) -> Request:
    return Request(rid=rid, prompt_ids=list(range(100, 100 + n)),
                   params=SamplingParams(max_new_tokens=4))


def test_sjf_overtakes_a_long_prompt_only_until_it_has_waited_its_limit():
    # Two fresh 8-token prompts every step fill the 16-token budget: by length alone, the
    # 48-token prompt would wait for ever.
    sched = Scheduler(SchedulerConfig(schedule_policy="sjf", sjf_max_wait_s=5.0,
                                      max_prefill_tokens=16, chunked_prefill_size=16),
                      BlockPool(1024, 16, False))
    long = _prefill_request("long", 48)
    sched.add(long)
    for step in range(6):
        for k in range(2):
            sched.add(_prefill_request(f"short-{step}-{k}", 8))
        if step == 3:
            long.arrival_time -= 5.0  # as if it had waited its 5 s
        batch = sched.schedule()
        sched.advance(batch)
        admitted = {r.rid for r in batch.reqs}
        if step < 3:
            assert "long" not in admitted and len(admitted) == 2
        else:
            assert "long" in admitted  # once past its limit, it is served in arrival order
        for r in list(batch.reqs):
            if r is not long and r.num_computed == r.num_tokens:
                sched.finish(r, Finish(kind="length"))
    sched.check_integrity()


def test_sjf_keeps_a_retracted_request_at_the_front():
    sched = Scheduler(SchedulerConfig(schedule_policy="sjf", sjf_max_wait_s=NEVER,
                                      max_prefill_tokens=64, chunked_prefill_size=64),
                      BlockPool(1024, 16, False))
    resumed = _prefill_request("resumed", 40)
    resumed.num_retractions = 1  # it was running: it goes back first, as under fcfs
    sched.add(_prefill_request("short", 30))
    sched.add(resumed)
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["resumed", "short"]
    assert batch.num_new == [40, 24]


def _shared_prefix_burst(n: int, prefix_len: int, seed: int = 1) -> list[TokenizedReq]:
    rng = random.Random(seed)
    doc = [rng.randrange(1000, 40000) for _ in range(prefix_len)]
    return [TokenizedReq(rid=f"q{i}", gateway_id="g",
                         input_ids=doc + [rng.randrange(1000, 40000)
                                          for _ in range(rng.randint(10, 40))],
                         params=SamplingParams(max_new_tokens=4, temperature=0.0,
                                               ignore_eos=True))
            for i in range(n)]


@pytest.mark.parametrize("policy", ["sjf", "fcfs"])
def test_a_burst_sharing_a_prefix_computes_the_prefix_once(tiny_model_dir, policy):
    """Twelve requests at once behind one 300-token document: one of them computes the
    document, the others wait for its blocks instead of computing them beside it, and then
    all of them run together, although the pool could not hold twelve unshared copies."""
    page, prefix = 16, 300
    engine = EngineCore(engine_args(tiny_model_dir, schedule_policy=policy, page_size=page,
                                    max_prefill_tokens=512, chunked_prefill_size=128,
                                    max_total_tokens=100 * page))  # 12 unshared need ~250 blocks
    reqs = _shared_prefix_burst(12, prefix)
    shared = prefix // page  # full blocks of the document; the partial one differs per request
    for r in reqs:
        engine.submit(r)
    pool = engine.pool
    computed = most_running = steps = 0
    while engine.has_work():
        steps += 1
        assert steps < 200, "no progress"
        engine.step()
        computed += engine.last_step.num_prefill_tokens
        most_running = max(most_running, len(engine.scheduler.running))
    engine.scheduler.check_integrity()
    prompts = sum(len(r.input_ids) for r in reqs)
    # a decode row is 1 token and not counted: each prompt's last token may be one
    once = prompts - (len(reqs) - 1) * shared * page
    assert once - len(reqs) <= computed <= once
    assert engine.scheduler.prefix_hits_total == (len(reqs) - 1) * shared * page
    tails = sum(-(-(len(r.input_ids) + 4) // page) - shared for r in reqs)
    assert pool.num_allocated_total <= shared + tails
    assert most_running == len(reqs)


def test_only_a_request_starting_on_a_block_in_flight_waits_for_it():
    """b's first block to compute is one a is computing: b waits, keeping its place, and starts
    from a's cached blocks. c wants its prompt's logprobs (a cached prefix has no logits, it
    computes its prompt anyway) and d shares nothing: both start at once."""
    pool = BlockPool(num_blocks=64, page_size=4)
    sched = Scheduler(SchedulerConfig(max_prefill_tokens=64, chunked_prefill_size=16,
                                      schedule_policy="fcfs"), pool)
    doc = list(range(100, 124))  # 6 blocks of 4
    a, b, c, d = (Request(rid=rid, prompt_ids=ids, params=SamplingParams(
                      max_new_tokens=2, prompt_logprobs=0 if rid == "c" else None))
                  for rid, ids in (("a", doc + [1]), ("b", doc + [2]), ("c", doc + [3]),
                                   ("d", list(range(500, 525)))))
    for r in (a, b, c, d):
        sched.add(r)
    batch = sched.schedule()
    assert [r.rid for r in batch.reqs] == ["a", "c", "d"]
    assert [r.rid for r in sched.waiting] == ["b"]
    sched.advance(batch)  # a computed 16 of its 25 tokens: 4 blocks cached, 2 still to come
    batch = sched.schedule()
    assert "b" not in [r.rid for r in batch.reqs]  # its next block is still a's to compute
    sched.advance(batch)  # a's prompt is computed: b starts from its 6 blocks
    batch = sched.schedule()
    assert dict(zip([r.rid for r in batch.reqs], batch.num_new, strict=True))["b"] == 1
    assert b.num_cached == 24
    sched.check_integrity()


def test_a_burst_behind_one_document_attends_it_once_with_the_same_tokens(smol_path,
                                                                          monkeypatch):
    """Cascade attention (attention/cascade.py) in the engine, on the real model (the tiny one
    runs SDPA, not the C++ kernels the cascades stand beside): the burst's questions and then its
    decodes attend the shared document as one group a layer, and every request's greedy tokens
    are those of the same burst with it turned off (TOKENLINE_CASCADE=0)."""
    import torch

    from services.scheduler.attention import cascade

    monkeypatch.setattr(cascade, "MIN_PAIRS", {torch.float32: 0, torch.bfloat16: 0})
    calls = {"decode": 0, "prompts": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(cascade, "attend", counted("decode", cascade.attend))
    monkeypatch.setattr(cascade, "attend_extend", counted("prompts", cascade.attend_extend))
    reqs = _shared_prefix_burst(8, 400, seed=3)
    for r in reqs:
        r.params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("TOKENLINE_CASCADE", setting)
        engine = EngineCore(engine_args(smol_path, page_size=16, max_total_tokens=4096))
        if engine.runner.attention_kernel != "native":
            pytest.skip(f"decode attention here is {engine.runner.attention_kernel}, not the "
                        "C++ kernel the cascades stand beside")
        for r in reqs:
            engine.submit(r)
        outs = []
        while engine.has_work():
            outs += engine.step()
        engine.scheduler.check_integrity()
        tokens[setting] = {r.rid: [t for o in outs if o.rid == r.rid for t in o.token_ids]
                           for r in reqs}
        if setting == "1":
            layers = engine.runner.num_layers
            assert calls["prompts"] >= layers and calls["decode"] >= 10 * layers, calls
            seen = dict(calls)
    assert calls == seen  # none with it off
    assert tokens["1"] == tokens["0"]
    assert all(len(t) == 12 for t in tokens["1"].values())
