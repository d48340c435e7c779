"""Property test of the block pool and scheduler with a fake model: no leak, no double free,
the step budget holds, and every request finishes, under random arrivals, lengths, priorities
and aborts; and the pool's KV events, replayed, always name exactly the blocks it caches."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.messages import AllBlocksCleared, BlockRemoved, BlockStored, Finish, SamplingParams
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request, Status
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig

request_st = st.tuples(
    st.integers(0, 30),  # arrival step
    st.integers(1, 70),  # prompt length
    st.integers(1, 40),  # output length
    st.integers(0, 3),  # priority
    st.one_of(st.none(), st.integers(0, 60)),  # abort at step
    st.integers(0, 3),  # prompt family: shared prefixes exercise the prefix cache
)


@settings(max_examples=150, deadline=None, derandomize=True,  # a fixed seed: the same cases
          suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=1, max_size=24),
    num_blocks=st.integers(8, 40),
    page_size=st.sampled_from([1, 4, 16]),
    # small chunks and budgets often: where a 1-token chunk and the budget's edge meet
    chunk=st.one_of(st.integers(1, 4), st.integers(1, 64)),
    budget=st.one_of(st.integers(1, 8), st.integers(1, 128)),
    max_running=st.integers(1, 16),
    policy=st.sampled_from(["sjf", "fcfs", "priority", "lpm"]),
    retraction=st.sampled_from(["length", "priority"]),
    batching=st.sampled_from(["continuous", "static", "dynamic"]),
    prefix_cache=st.booleans(),
    conservativeness=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_random_workloads_never_leak_and_always_finish(
    reqs, num_blocks, page_size, chunk, budget, max_running, policy, retraction, batching,
    prefix_cache, conservativeness,
):
    pool = BlockPool(num_blocks, page_size, prefix_cache)
    sched = Scheduler(
        SchedulerConfig(max_running_requests=max_running, chunked_prefill_size=chunk,
                        max_prefill_tokens=budget, schedule_policy=policy,
                        retraction_policy=retraction, batching=batching, batch_wait_ms=0,
                        conservativeness=conservativeness),
        pool,
    )
    pool.record_events()
    replayed: set[bytes] = set()  # what a router that saw every event believes is cached
    rng = random.Random(0)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    live: dict[int, Request] = {}
    done: set[int] = set()
    step = 0
    while pending or sched.has_work():
        step += 1
        assert step < 20000, "no progress"
        while pending and pending[0][1][0] <= step:
            i, (_, plen, olen, prio, _, family) = pending.pop(0)
            prompt = [family * 1000 + t for t in range(plen)]
            r = Request(rid=str(i), prompt_ids=prompt, priority=prio,
                        params=SamplingParams(max_new_tokens=olen))
            live[i] = r
            sched.add(r)
        for i, r in list(live.items()):
            abort_at = reqs[i][4]
            if abort_at is not None and step >= abort_at and not r.is_finished:
                sched.finish(r, Finish(kind="abort"))
        batch = sched.schedule()
        # the step budget: prompt tokens within the budget, each chunk within its limit. A
        # chunk is a prefill unless it is one token after a fully computed prompt (a decode):
        # a 1-token chunk of a prompt counts too.
        prefill = [n for r, n in zip(batch.reqs, batch.num_new, strict=True)
                   if n > 1 or r.num_computed < len(r.prompt_ids)]
        assert sum(prefill) <= budget
        assert all(n <= chunk for n in prefill)
        assert len(sched.running) <= max_running
        for r, n in zip(batch.reqs, batch.num_new, strict=True):
            assert r.status is Status.RUNNING
            assert len(r.block_table) * page_size >= r.num_computed + n
        sched.advance(batch)
        for r in batch.reqs:
            if r.num_computed == r.num_tokens and not r.is_finished:
                r.output_ids.append(rng.randrange(50000))
                if r.num_generated >= r.params.max_new_tokens:
                    sched.finish(r, Finish(kind="length"))
        sched.check_integrity()  # books balance at every step boundary, not only when idle
        _replay(replayed, pool.take_events())
        assert replayed == set(pool.block_of)
        for i, r in list(live.items()):
            if r.is_finished:
                done.add(i)
                if r.finish.kind == "length":
                    assert r.num_generated == r.params.max_new_tokens
                del live[i]
    assert done == set(range(len(reqs)))
    sched.check_integrity()
    assert pool.num_used == 0
    assert pool.num_free + pool.num_cached == num_blocks
    pool.flush()
    assert pool.num_free == num_blocks
    _replay(replayed, pool.take_events())
    assert replayed == set()


def _replay(blocks: set[bytes], events: list) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            blocks.clear()
        elif isinstance(event, BlockRemoved):
            assert blocks >= set(event.block_hashes), "removed a block never stored"
            blocks.difference_update(event.block_hashes)
        else:
            assert isinstance(event, BlockStored)
            assert event.parent_block_hash is None or event.parent_block_hash in blocks \
                or event.parent_block_hash in event.block_hashes, "orphan block"
            blocks.update(event.block_hashes)
