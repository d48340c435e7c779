"""Cache-aware routing: two schedulers, two tokenizers, one NATS server, the tiny random model.

Multi-turn conversations re-send their whole history; with `cache_aware` each turn lands where
its previous turn's blocks are cached, with `random` (the queue group) it often does not. A
burst sharing one prefix still runs on both schedulers (the imbalance rule); a router started
late, or one that missed an event batch, catches up through a snapshot; and a scheduler killed
with `kill -9` drops out of every router's view while the conversations go on on the survivor.

The tests share one set of schedulers, a detokenizer and a gateway, and run in order; the
tokenizers (the routers) are swapped between phases for the method under test.
"""

from __future__ import annotations

import asyncio
import random

import aiohttp
import nats
import pytest

from common import messages
from common.subjects import Subjects
from tests.helpers import free_port, metric, wait_healthy
from tests.integration.procs import ServiceProc, StatsWatch

pytestmark = pytest.mark.stack  # starts services as processes (make test-fast skips it)

HEARTBEAT_TIMEOUT = 3.0
PAGE = 16
FLAGS = ["--heartbeat-timeout", str(HEARTBEAT_TIMEOUT), "--stats-interval", "0.3",
         "--page-size", str(PAGE), "--max-total-tokens", "16384"]
SCHEDULERS = ("sched-a", "sched-b")
CONVERSATIONS, TURNS = 8, 5
FIRST_PROMPT, USER_TURN, ANSWER = 50, 12, 8


class Stack:
    def __init__(self, nats_url: str, model: str) -> None:
        self.nats_url = nats_url
        self.flags = ["--nats-url", nats_url, "--model", model, *FLAGS]
        self.procs: dict[str, ServiceProc] = {}
        self.tokenizers: list[str] = []
        self.watch = StatsWatch(nats_url)
        self.url = ""

    def start(self, name: str, service: str, *flags: str) -> None:
        self.procs[name] = ServiceProc.of(service, *self.flags, *flags, "--instance-id", name,
                                          tag=f"routing-{name}").start()

    async def use_tokenizers(self, tag: str, *flags: str, n: int = 2) -> None:
        """Replace the routers: `n` tokenizers with these flags, each with both views synced
        (random keeps none)."""
        for name in self.tokenizers:
            self.procs.pop(name).stop()
        self.tokenizers = [f"tok-{tag}-{i}" for i in range(n)]
        for name in self.tokenizers:
            self.start(name, "tokenizer", *flags)
        routing = "random" not in flags
        await self.wait_for(lambda: all(
            name in self.watch.of("tokenizer") and
            (not routing or set(self.watch.of("tokenizer")[name].router_view or {}) ==
             set(SCHEDULERS)) for name in self.tokenizers),
            f"tokenizers {self.tokenizers} up with a view of both schedulers")

    async def wait_for(self, predicate, what: str, timeout: float = 120) -> None:
        try:
            await self.watch.wait_for(predicate, timeout=timeout, what=what)
        except TimeoutError:
            for p in self.procs.values():
                print(f"--- {p.name} ({p.log_path})\n{p.logs()}")
            raise

    def scheduler_stats(self) -> dict[str, messages.StatsOut]:
        return {s: st for s, st in self.watch.of("scheduler").items() if s in SCHEDULERS}

    def live_tokenizer_stats(self) -> list[messages.StatsOut]:
        return [s for i, s in self.watch.of("tokenizer").items() if i in self.tokenizers]

    async def idle(self) -> None:
        await self.wait_for(lambda: all(
            s.in_flight == 0 and s.num_running == 0 and s.num_waiting == 0
            for s in self.scheduler_stats().values() if self.procs[s.instance_id].alive()),
            "schedulers idle")

    async def flush(self, session: aiohttp.ClientSession) -> None:
        await self.idle()
        async with session.post(self.url + "/flush_cache") as r:
            assert r.status == 200, await r.text()


@pytest.fixture(scope="module")
async def stack(nats_server, tiny_model_dir):
    st = Stack(nats_server.url, str(tiny_model_dir))
    await st.watch.start()
    st.start("detok", "detokenizer")
    for sid in SCHEDULERS:
        st.start(sid, "scheduler", "--num-threads", "1")
    port = free_port()
    st.start("gateway", "gateway", "--port", str(port))
    st.url = f"http://127.0.0.1:{port}"
    try:
        await st.wait_for(lambda: set(st.scheduler_stats()) == set(SCHEDULERS),
                          "both schedulers up", timeout=240)
        await asyncio.to_thread(wait_healthy, st.url, 120, path="/v1/models")
        yield st
    finally:  # also when start-up failed: no process outlives the module
        await st.watch.close()
        for p in st.procs.values():
            p.stop()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def generate(session: aiohttp.ClientSession, url: str, input_ids: list[int],
                   max_new: int = ANSWER) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    async with session.post(url + "/generate", json=body) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


async def converse(session: aiohttp.ClientSession, url: str, seed: int,
                   done: list[int] | None = None) -> list[tuple[int, int]]:
    """One conversation, each turn re-sending the whole history; (prompt, cached) per turn."""
    rng = random.Random(seed)
    prompt = _tokens(rng, FIRST_PROMPT)
    turns = []
    for _ in range(TURNS):
        data = await generate(session, url, prompt)
        turns.append((len(prompt), data["meta_info"]["cached_tokens"]))
        prompt = prompt + data["output_ids"] + _tokens(rng, USER_TURN)
        if done is not None:
            done.append(1)
    return turns


async def conversations(stack: Stack, seed: int) -> list[list[tuple[int, int]]]:
    async with aiohttp.ClientSession() as session:
        await stack.flush(session)
        return await asyncio.gather(*(converse(session, stack.url, seed + c)
                                      for c in range(CONVERSATIONS)))


CACHED: dict[str, int] = {}


def decided(stack: Stack, reason: str) -> int:
    """Routing decisions for `reason` by this phase's tokenizers, as their heartbeats say."""
    return sum((s.route_decisions_total or {}).get(reason, 0)
               for s in stack.live_tokenizer_stats())


async def test_cache_aware_turns_find_their_history_cached(stack):
    await stack.use_tokenizers("aware", "--load-balance-method", "cache_aware")
    results = await conversations(stack, 1000)
    for conv in results:
        for (prev_prompt, _), (_, cached) in zip(conv, conv[1:], strict=False):
            assert cached >= prev_prompt // PAGE * PAGE, conv  # on whichever scheduler has it
    CACHED["cache_aware"] = sum(cached for conv in results for _, cached in conv)
    await stack.wait_for(lambda: decided(stack, "cache_hit") >= CONVERSATIONS * (TURNS - 1),
                         "every later turn routed for its cache hit", timeout=10)
    # /metrics: decisions by reason, and the router's prediction against what was found
    await stack.idle()
    deadline = asyncio.get_running_loop().time() + 10
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(stack.url + "/metrics") as r:
                text = await r.text()
            hits = metric(text, "tokenline:router_decisions_total", reason="cache_hit")
            predicted = metric(text, "tokenline:router_predicted_cached_tokens_total")
            found = metric(text, "tokenline:router_cached_tokens_total")
            if hits >= CONVERSATIONS * (TURNS - 1) and predicted == found > 0 or \
                    asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.3)
    assert hits >= CONVERSATIONS * (TURNS - 1)
    assert predicted == found == CACHED["cache_aware"]  # nothing evicted in between: exact
    # both schedulers served conversations: the hits did not come from piling onto one
    assert all(s.prefix_cache_hits_total > 0 for s in stack.scheduler_stats().values())


async def test_random_routing_caches_measurably_less(stack):
    await stack.use_tokenizers("random", "--load-balance-method", "random")
    results = await conversations(stack, 2000)
    CACHED["random"] = sum(cached for conv in results for _, cached in conv)
    print(f"\ncached prompt tokens over {CONVERSATIONS}x{TURNS} turns: "
          f"cache_aware {CACHED['cache_aware']}, random {CACHED['random']}")
    # a turn caches at most what cache_aware gets it; random falls short whenever a turn lands
    # away from its history (all 32 landing right by chance: 2**-32)
    assert CACHED["random"] <= CACHED["cache_aware"] - PAGE


async def test_a_burst_sharing_one_prefix_runs_on_both_schedulers(stack):
    await stack.use_tokenizers("balance", "--load-balance-method", "cache_aware",
                               "--balance-abs-threshold", "4")
    rng = random.Random(3000)
    shared = _tokens(rng, 96)
    async with aiohttp.ClientSession() as session:
        await stack.flush(session)
        # what the last phase left cached is gone from every router's view too
        await stack.wait_for(lambda: all(t.router_view == dict.fromkeys(SCHEDULERS, 0)
                                         for t in stack.live_tokenizer_stats()),
                             "every view empty after /flush_cache", timeout=10)
        await generate(session, stack.url, shared + _tokens(rng, 4), 4)  # one holds it first
        await stack.idle()
        before = {s: st.prompt_tokens_total for s, st in stack.scheduler_stats().items()}
        await asyncio.gather(*(generate(session, stack.url, shared + _tokens(rng, 4), 4)
                               for _ in range(40)))
    await stack.wait_for(lambda: all(
        stack.scheduler_stats()[s].prompt_tokens_total > before[s] for s in SCHEDULERS),
        "prompt tokens counted at both schedulers", timeout=20)
    await stack.wait_for(lambda: decided(stack, "cache_hit") > 0 and
                         decided(stack, "imbalance") > 0, "hits, then imbalance", timeout=10)


def _views_match(stack: Stack, tokenizers: list[str]) -> bool:
    """Every router's view of each scheduler holds what that scheduler caches (idle: all its
    hashed blocks are unreferenced, so its cached-block count is the whole set)."""
    truth = {s: st.kv_cached_blocks for s, st in stack.scheduler_stats().items()}
    toks = stack.watch.of("tokenizer")
    return all(t in toks and (toks[t].router_view or {}) == truth for t in tokenizers)


async def test_a_router_started_late_catches_up_through_a_snapshot(stack):
    await stack.idle()
    truth = {s: st.kv_cached_blocks for s, st in stack.scheduler_stats().items()}
    assert all(truth.values())  # the burst left blocks cached on both
    stack.start("tok-late", "tokenizer", "--load-balance-method", "cache_aware")
    stack.tokenizers.append("tok-late")
    await stack.wait_for(lambda: _views_match(stack, ["tok-late"]), "the late router's view")
    assert stack.watch.of("tokenizer")["tok-late"].kv_snapshots_total >= len(SCHEDULERS)


async def test_a_missed_event_batch_recovers_through_a_snapshot(stack):
    await stack.idle()
    sid = SCHEDULERS[0]
    before = {t.instance_id: t.kv_snapshots_total for t in stack.live_tokenizer_stats()}
    seq = stack.scheduler_stats()[sid].kv_events_seq
    # What a router sees when a batch is lost: the next one's number jumps. This one also
    # claims a block the scheduler never had, which only a snapshot can take back out.
    lost = messages.KvEventsOut(scheduler_id=sid, seq=seq + 2, block_size=PAGE,
                                events=[messages.BlockStored([b"\x00" * 32])])
    nc = await nats.connect(stack.nats_url)
    await nc.publish(Subjects().kv_events(sid), messages.encode(lost))
    await nc.flush()
    await nc.close()
    await stack.wait_for(lambda: all(
        t.kv_snapshots_total > before[t.instance_id] for t in stack.live_tokenizer_stats()),
        "every router asked for a snapshot")
    await stack.wait_for(lambda: _views_match(stack, stack.tokenizers), "views repaired")
    # and the events that follow apply on top of the snapshot
    async with aiohttp.ClientSession() as session:
        await generate(session, stack.url, _tokens(random.Random(4000), 70))
    await stack.idle()
    await stack.wait_for(lambda: _views_match(stack, stack.tokenizers), "views up to date")


async def test_a_killed_scheduler_leaves_every_view_and_conversations_go_on(stack):
    if not stack.tokenizers:  # run on its own
        await stack.use_tokenizers("kill", "--load-balance-method", "cache_aware")
    done: list[int] = []
    async with aiohttp.ClientSession() as session:
        await stack.flush(session)
        tasks = [asyncio.create_task(converse(session, stack.url, 5000 + c, done))
                 for c in range(CONVERSATIONS)]
        await stack.wait_for(lambda: len(done) >= CONVERSATIONS, "first turns done")
        doomed, survivor = SCHEDULERS[1], SCHEDULERS[0]
        stack.procs[doomed].kill()
        await stack.wait_for(lambda: all(doomed not in (t.router_view or {})
                                         for t in stack.live_tokenizer_stats()),
                             "the dead scheduler gone from every view",
                             timeout=HEARTBEAT_TIMEOUT + 2)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
    assert all(len(conv) == TURNS for conv in results)
    views = [t.router_view or {} for t in stack.live_tokenizer_stats()]
    assert all(set(v) == {survivor} for v in views)
    await stack.idle()
    s = stack.scheduler_stats()[survivor]
    assert s.kv_free_blocks + s.kv_cached_blocks == s.kv_total_blocks
