"""Prefix caching: a re-sent conversation is not computed again, and the output is the same."""

from __future__ import annotations

import random

import pytest

from common.messages import SamplingParams, TokenizedReq
from common.modelstore import model_info
from services.scheduler.core.engine import EngineCore
from services.tokenizer.tokenize import TextTokenizer
from tests.helpers import engine_args, run_engine

QUESTIONS = [
    "Hi! What is the capital of France?",
    "And what river flows through it?",
    "Name a famous museum there.",
    "What can I see in that museum?",
    "Thanks. Summarize our chat in one sentence.",
]


def _replay(engine: EngineCore, tok: TextTokenizer) -> list[tuple[list[int], int]]:
    """Play a 5-turn chat, re-sending the whole conversation each turn as clients do."""
    messages: list[dict] = []
    turns = []
    for i, q in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": q})
        ids = tok.encode_chat([dict(m) for m in messages])
        req = TokenizedReq(rid=f"turn{i}", gateway_id="g", input_ids=ids,
                           params=SamplingParams(max_new_tokens=24, temperature=0.0))
        engine.submit(req)
        out, cached = [], 0
        while engine.has_work():
            for o in engine.step():
                out += o.token_ids
                if o.finish is not None:
                    cached = o.cached_tokens
        turns.append((out, cached))
        messages.append({"role": "assistant",
                         "content": tok.tokenizer.decode(out, skip_special_tokens=True)})
    return turns


def test_five_turn_chat_is_identical_with_and_without_the_cache(smol_path):
    tok = TextTokenizer(model_info(smol_path))
    with_cache = EngineCore(engine_args(smol_path, max_total_tokens=8192,
                                        debug_check_integrity=True))
    without = EngineCore(engine_args(smol_path, max_total_tokens=8192,
                                     disable_prefix_cache=True))
    on = _replay(with_cache, tok)
    off = _replay(without, tok)
    assert [t for t, _ in on] == [t for t, _ in off]
    assert all(c == 0 for _, c in off)
    assert all(c >= 32 for _, c in on[1:])  # later turns reuse the earlier conversation
    stats = with_cache.stats()
    assert stats["prefix_cache_hits_total"] == sum(c for _, c in on)
    assert stats["prefix_cache_queries_total"] > stats["prefix_cache_hits_total"]


def test_full_pool_of_cached_blocks_is_evicted_for_new_requests(tiny_model_dir):
    """Rounds that need blocks only eviction can give, each re-sending a prompt of the last
    round (still cached) and one of the first round (evicted, its blocks now holding other
    tokens): every answer equals a cache-off run's, so no stale prefix serves wrong KV."""
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=256, page_size=8,
                                    debug_check_integrity=True))
    reference = EngineCore(engine_args(tiny_model_dir, disable_prefix_cache=True))
    rng = random.Random(0)
    rounds: list[list[list[int]]] = []

    def batch(tag: str) -> list[TokenizedReq]:
        again = [rounds[-1][-1]] if rounds else []  # the last round's: still cached
        if len(rounds) > 1:  # one of the first round's: evicted long ago
            again.append(rounds[0][len(rounds) - 1])
        prompts = again + [[rng.randrange(1000, 40000) for _ in range(40)]
                           for _ in range(4 - len(again))]
        rounds.append(prompts)
        return [TokenizedReq(rid=f"{tag}{i}", gateway_id="g", input_ids=p,
                             params=SamplingParams(max_new_tokens=16, temperature=0.0,
                                                   ignore_eos=True))
                for i, p in enumerate(prompts)]

    run_engine(engine, batch("first"))
    assert engine.pool.num_cached > 0 and engine.pool.num_used == 0
    for round_ in range(4):
        evicted, hits = engine.pool.num_evictions_total, engine.scheduler.prefix_hits_total
        reqs = batch(f"r{round_}")
        tokens, finish, _ = run_engine(engine, reqs, max_steps=500)
        assert engine.pool.num_evictions_total > evicted  # it did need the cached blocks
        assert engine.scheduler.prefix_hits_total > hits  # and the re-sent prompt was served
        assert all(f.kind == "length" for f in finish.values())
        want, _, _ = run_engine(reference, reqs)
        assert tokens == want, round_
    engine.check_integrity()
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_blocks


def test_hit_never_covers_the_last_prompt_token(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=1024, page_size=8))
    prompt = list(range(1000, 1032))  # exactly four full blocks
    req = lambda rid: TokenizedReq(rid=rid, gateway_id="g", input_ids=prompt,  # noqa: E731
                                   params=SamplingParams(max_new_tokens=4, temperature=0.0,
                                                         ignore_eos=True))
    first, _, _ = run_engine(engine, [req("a")])
    engine.submit(req("b"))
    outs = []
    while engine.has_work():
        outs += engine.step()
    cached = [o.cached_tokens for o in outs if o.finish is not None][0]
    assert cached == 24  # three blocks: the fourth holds the last prompt token
    assert [t for o in outs for t in o.token_ids] == first["a"]


@pytest.mark.parametrize("policy", ["lpm", "fcfs"])
def test_schedule_policies_give_the_same_tokens(tiny_model_dir, policy):
    engine = EngineCore(engine_args(tiny_model_dir, schedule_policy=policy,
                                    max_running_requests=2))
    shared = list(range(2000, 2048))
    reqs = [TokenizedReq(rid=f"q{i}", gateway_id="g", input_ids=shared + [3000 + i] * (i + 1),
                         params=SamplingParams(max_new_tokens=6, temperature=0.0,
                                               ignore_eos=True)) for i in range(6)]
    tokens, _, _ = run_engine(engine, reqs)
    solo = EngineCore(engine_args(tiny_model_dir, disable_prefix_cache=True))
    ref, _, _ = run_engine(solo, reqs)
    assert tokens == ref
