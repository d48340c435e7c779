"""The shared block hash: what the router computes for a request is what the scheduler caches."""

from __future__ import annotations

from common.block_hash import ROOT_HASH, block_hash, prefix_block_hashes
from common.messages import Finish, SamplingParams
from services.scheduler.core.kv_pool import BlockPool
from services.scheduler.core.request import Request
from services.scheduler.core.scheduler import Scheduler, SchedulerConfig


def _run_once(sched: Scheduler, rid: str, tokens: list[int]) -> Request:
    req = Request(rid=rid, prompt_ids=tokens, params=SamplingParams(max_new_tokens=1))
    sched.add(req)
    sched.advance(sched.schedule())
    sched.finish(req, Finish(kind="length"))
    return req


def test_router_hashes_name_exactly_the_blocks_the_scheduler_caches():
    pool = BlockPool(32, 4)
    sched = Scheduler(SchedulerConfig(), pool)
    tokens = list(range(100, 119))  # 19 tokens: 4 full blocks and 3 more
    _run_once(sched, "a", tokens)
    assert set(pool.block_of) == set(prefix_block_hashes(tokens, 4))
    assert len(pool.block_of) == 4
    # a longer prompt over the same prefix hits exactly the blocks the router predicts
    longer = tokens + list(range(7))
    predicted = [h for h in prefix_block_hashes(longer, 4) if h in pool.block_of]
    req = _run_once(sched, "b", longer)
    assert req.num_cached == 4 * 4 == len(predicted) * 4


def test_a_salt_changes_every_block_and_no_salt_is_the_default():
    tokens = list(range(40))
    plain = prefix_block_hashes(tokens, 8)
    assert prefix_block_hashes(tokens, 8, salt=None) == plain
    assert plain[0] == block_hash(ROOT_HASH, tokens[:8])
    salted = prefix_block_hashes(tokens, 8, salt="tenant-a")
    assert len(salted) == len(plain) == 4
    assert not set(salted) & set(plain)
    assert not set(salted) & set(prefix_block_hashes(tokens, 8, salt="tenant-b"))
    assert salted == prefix_block_hashes(tokens, 8, salt="tenant-a")


def test_an_adapter_changes_every_block_apart_from_salts():
    """One prompt under two LoRA adapters, an adapter and the base, or an adapter and a salt
    spelled like it never shares a block; the scheduler hashes a request's adapter the same."""
    tokens = list(range(40))
    base = set(prefix_block_hashes(tokens, 8))
    a = prefix_block_hashes(tokens, 8, adapter="a")
    assert not set(a) & base
    assert not set(a) & set(prefix_block_hashes(tokens, 8, adapter="b"))
    assert not set(a) & set(prefix_block_hashes(tokens, 8, salt="a"))
    both = prefix_block_hashes(tokens, 8, salt="t", adapter="a")
    assert not set(both) & set(a) and not set(both) & set(prefix_block_hashes(tokens, 8, "t"))
    sched = Scheduler(SchedulerConfig(), BlockPool(64, 8, True))
    req = Request(rid="r", prompt_ids=tokens, params=SamplingParams(), lora_name="a")
    assert sched._hashes(req) == a


def test_forgetting_an_adapter_drops_its_cached_blocks_alone():
    """An unloaded adapter's cached blocks stop being found (and the router hears it); the
    base's and other adapters' stay; an evicted block takes its tag with it."""
    pool = BlockPool(8, 4)
    pool.record_events()
    blocks = pool.allocate(4)
    hashes = {tag: prefix_block_hashes(list(range(12)), 4, None, tag) for tag in ("a", "b", None)}
    pool.register(blocks[0], hashes["a"][0], None, "a")
    pool.register(blocks[1], hashes["a"][1], hashes["a"][0], "a")
    pool.register(blocks[2], hashes["b"][0], None, "b")
    pool.register(blocks[3], hashes[None][0], None)
    pool.release(blocks)
    pool.take_events()
    assert pool.forget("a") == 2
    assert pool.match_prefix(hashes["a"]) == []
    assert pool.match_prefix(hashes["b"][:1]) == [blocks[2]]
    assert pool.match_prefix(hashes[None][:1]) == [blocks[3]]
    assert [e.block_hashes for e in pool.take_events()] == [hashes["a"][:2]]
    assert pool.num_free == 6 and pool.forget("a") == 0
    pool.allocate(8)  # evicts every cached block, "b"'s tag with its block
    assert pool.tag_of == {}
    pool.check_integrity()
