"""`cache_salt`: requests share cached blocks only with requests of the same salt (or, without
one, with other unsalted requests, as before), through retraction and migration too."""

from __future__ import annotations

import asyncio
import random

from common.config import ServerArgs
from common.messages import GenerateReq, SamplingParams, TokenizedReq
from services.gateway.tracker import Tracker
from services.scheduler.core.engine import EngineCore
from services.scheduler.core.request import Request
from services.tokenizer.server import TokenizerService
from tests.helpers import engine_args

PROMPT = [random.Random(0).randrange(1000, 40000) for _ in range(1200)]


def _cached(engine: EngineCore, rid: str, prompt: list[int], salt: str | None) -> int:
    """Run one request alone; the cached_tokens it reports."""
    engine.submit(TokenizedReq(rid=rid, gateway_id="g", input_ids=prompt, cache_salt=salt,
                               params=SamplingParams(max_new_tokens=2, temperature=0.0)))
    cached = None
    while engine.has_work():
        for out in engine.step():
            if out.finish is not None:
                cached = out.cached_tokens
    assert cached is not None
    return cached


def test_only_requests_with_the_same_salt_share_cached_blocks(tiny_model_dir):
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=16384, page_size=16,
                                    max_model_len=2048, debug_check_integrity=True))
    assert _cached(engine, "plain", PROMPT, None) == 0
    assert _cached(engine, "plain-again", PROMPT, None) >= 1000  # unsalted: shared as before
    assert _cached(engine, "alice", PROMPT, "tenant-alice") == 0
    assert _cached(engine, "bob", PROMPT, "tenant-bob") == 0
    assert _cached(engine, "alice-again", PROMPT, "tenant-alice") >= 1000
    assert _cached(engine, "bob-again", PROMPT, "tenant-bob") >= 1000
    assert _cached(engine, "empty-salt", PROMPT, "") == 0  # a salt, even "", is not "none"
    engine.check_integrity()


def test_salted_blocks_stay_salted_through_retraction(tiny_model_dir):
    # A pool too small for the batch: requests are retracted and resumed by recomputation.
    engine = EngineCore(engine_args(tiny_model_dir, max_total_tokens=640, page_size=8,
                                    schedule_conservativeness=0.0, debug_check_integrity=True))
    prompt = PROMPT[:40]
    reqs = [TokenizedReq(rid=f"t{i}", gateway_id="g", input_ids=prompt, cache_salt=f"tenant-{i}",
                         params=SamplingParams(max_new_tokens=48, temperature=0.0,
                                               ignore_eos=True)) for i in range(16)]
    cached: dict[str, int] = {}
    retracted: dict[str, int] = {}
    for r in reqs:
        engine.submit(r)
    while engine.has_work():
        for out in engine.step():
            if out.finish is not None:
                cached[out.rid] = out.cached_tokens
                retracted[out.rid] = out.retractions
    assert sum(retracted.values()) >= 3, retracted
    assert cached == dict.fromkeys(cached, 0)  # the same prompt, yet no tenant shares a block
    # what the resumed requests computed again is cached under their own salts only
    assert _cached(engine, "probe-unsalted", prompt, None) == 0
    assert _cached(engine, "probe-stranger", prompt, "tenant-x") == 0
    engine.check_integrity()
    assert engine.pool.num_used == 0


def test_a_moved_request_keeps_its_salt_on_the_way_to_the_engine(tiny_model_dir):
    """Moved off a dead scheduler, a request is sent again from the gateway's copy: the salt
    must ride along through the tokenizer to the new scheduler's engine."""
    tracker = Tracker()
    sent = GenerateReq(rid="r", gateway_id="g", params=SamplingParams(temperature=0.0),
                       text="hello there", cache_salt="tenant-a")
    sub = tracker.add(sent, 0, asyncio.Queue())
    tracker.accept("r", "sched-dead")
    moved = tracker.move(sub, "sched-alive")
    tokenized = TokenizerService(ServerArgs(model=str(tiny_model_dir))).tokenize(moved)
    assert Request.from_msg(tokenized).cache_salt == "tenant-a"
