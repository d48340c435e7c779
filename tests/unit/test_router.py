"""The router's core: views kept from KV events and snapshots, and SGLang router's rule."""

from __future__ import annotations

import pytest

from common.block_hash import prefix_block_hashes
from common.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventsOut,
    KvSnapshotOut,
    StatsOut,
)
from services.tokenizer.router import Router

BS = 4
SYSTEM = list(range(1000, 1040))  # 10 blocks


def heartbeat(sid: str, running: int = 0, waiting: int = 0, seq: int = 0,
              free: int = 100) -> StatsOut:
    return StatsOut(service="scheduler", instance_id=sid, time=0.0, num_running=running,
                    num_waiting=waiting, kv_free_blocks=free, kv_events_seq=seq)


def stored(sid: str, seq: int, tokens: list[int], salt: str | None = None,
           cleared: bool = False) -> KvEventsOut:
    hashes = prefix_block_hashes(tokens + [0], BS, salt)
    events = [AllBlocksCleared()] if cleared else []
    return KvEventsOut(scheduler_id=sid, seq=seq, block_size=BS,
                       events=[*events, BlockStored(hashes)])


def two_schedulers(**kw) -> Router:
    router = Router(heartbeat_timeout=5.0, **kw)
    for sid in ("a", "b"):
        router.on_events(KvEventsOut(scheduler_id=sid, seq=1, block_size=BS,
                                     events=[AllBlocksCleared()]), 0.0)
        assert not router.on_heartbeat(heartbeat(sid, seq=1), 0.0)
    return router


def test_a_request_goes_where_its_prefix_is_cached():
    router = two_schedulers()
    router.on_events(stored("b", 2, SYSTEM), 0.0)
    route = router.route(SYSTEM + [7, 8, 9], 0.1)
    assert (route.scheduler_id, route.reason) == ("b", "cache_hit")
    assert route.predicted_tokens == len(SYSTEM)
    # a prompt with nothing cached anywhere goes to the least loaded (b now has one routed)
    route = router.route(list(range(50)), 0.1)
    assert (route.scheduler_id, route.reason) == ("a", "cache_miss")
    assert router.decisions == {"cache_hit": 1, "cache_miss": 1}


def test_imbalance_overrides_the_cache_sglang_rule():
    router = two_schedulers(balance_abs_threshold=4, balance_rel_threshold=1.5)
    router.on_events(stored("b", 2, SYSTEM), 0.0)
    router.on_heartbeat(heartbeat("b", running=5, seq=2), 0.0)  # 5 - 0 > 4 and 5 > 0 * 1.5
    route = router.route(SYSTEM + [1], 0.1)
    assert (route.scheduler_id, route.reason) == ("a", "imbalance")
    router.on_heartbeat(heartbeat("a", running=4, seq=1), 0.2)  # 5 - 4 <= 4: balanced
    assert router.route(SYSTEM + [1], 0.3).scheduler_id == "b"


def test_requests_sent_since_the_last_heartbeat_count_as_load():
    router = two_schedulers(balance_abs_threshold=2)
    router.on_events(stored("a", 2, SYSTEM), 0.0)
    chosen = [router.route(SYSTEM + [i], 0.1).scheduler_id for i in range(8)]
    assert chosen[:3] == ["a", "a", "a"] and "b" in chosen  # a burst does not pile up


def test_removed_blocks_and_flushes_leave_the_view():
    router = two_schedulers()
    router.on_events(stored("a", 2, SYSTEM), 0.0)
    hashes = prefix_block_hashes(SYSTEM + [0], BS)
    router.on_events(KvEventsOut("a", 3, BS, [BlockRemoved(hashes[5:])]), 0.0)
    assert router.views["a"].matched_blocks(hashes) == 5
    router.on_events(KvEventsOut("a", 4, BS, [AllBlocksCleared()]), 0.0)
    assert router.view_sizes() == {"a": 0, "b": 0}


def test_a_gap_in_sequence_numbers_recovers_through_a_snapshot():
    router = two_schedulers()
    assert router.on_events(stored("a", 3, SYSTEM), 0.0)  # seq 2 was lost
    router.snapshot_sent("a")
    late = stored("a", 6, SYSTEM[:8] + [5, 5, 5, 5])  # arrives while the snapshot is out
    assert not router.on_events(late, 0.0)
    truth = prefix_block_hashes(SYSTEM + [0], BS)
    assert not router.on_snapshot(KvSnapshotOut("a", 5, BS, truth), "a")
    view = router.views["a"]
    assert view.seq == 6 and view.blocks == set(truth) | set(prefix_block_hashes(
        SYSTEM[:8] + [5, 5, 5, 5, 0], BS))
    assert router.snapshots_total == 1


def test_a_router_started_late_asks_each_scheduler_for_a_snapshot():
    router = Router()
    assert router.on_heartbeat(heartbeat("a", seq=7), 0.0)  # never heard its events
    router.snapshot_sent("a")
    assert not router.on_heartbeat(heartbeat("a", seq=7), 1.0)  # one at a time
    router.on_snapshot(KvSnapshotOut("a", 7, BS, prefix_block_hashes(SYSTEM + [0], BS)), "a")
    assert router.view_sizes() == {"a": 10}
    assert not router.on_heartbeat(heartbeat("a", seq=7), 2.0)


def test_the_last_batch_lost_shows_in_the_next_heartbeat_but_one():
    router = two_schedulers()
    assert not router.on_heartbeat(heartbeat("a", seq=2), 1.0)  # batch 2 may still be coming
    assert router.on_heartbeat(heartbeat("a", seq=2), 2.0)  # an interval later: it was lost


def test_a_restarted_scheduler_starts_over_without_a_snapshot():
    router = two_schedulers()
    router.on_events(stored("a", 2, SYSTEM), 0.0)
    assert not router.on_events(KvEventsOut("a", 1, BS, [AllBlocksCleared()]), 1.0)
    assert router.view_sizes()["a"] == 0 and router.views["a"].seq == 1


def test_a_salted_prefix_matches_only_the_same_salt():
    router = two_schedulers()
    router.on_events(stored("b", 2, SYSTEM, salt="tenant-1"), 0.0)
    assert router.route(SYSTEM + [1], 0.1, salt="tenant-1").reason == "cache_hit"
    miss = router.route(SYSTEM + [1], 0.1)
    assert miss.reason == "cache_miss" and miss.predicted_tokens == 0


def test_silent_schedulers_drop_out_and_one_left_means_the_queue_group():
    router = two_schedulers()
    router.on_heartbeat(heartbeat("b", seq=1), 4.0)
    assert router.expire(5.5) == ["a"]
    assert router.view_sizes() == {"b": 0}
    route = router.route(SYSTEM, 5.6)
    assert (route.scheduler_id, route.reason) == (None, "queue_group")


def test_silence_during_a_nats_cut_does_not_count():
    router = two_schedulers()  # last heard at 0.0; the connection was back at 10.0
    router.on_connection(True, 10.0)
    assert router.expire(12.0) == []
    assert router.route(SYSTEM, 12.0).reason != "queue_group"  # both still routable
    assert router.expire(15.5) == ["a", "b"]  # silent for a timeout since the reconnection


def test_fallback_forgets_the_scheduler_that_did_not_answer():
    router = two_schedulers()
    route = router.route(SYSTEM, 0.1)
    assert router.fell_back(route).reason == "fallback"
    assert route.scheduler_id not in router.views


@pytest.mark.parametrize("method,expect", [
    ("round_robin", ["a", "b", "a", "b"]),
    ("shortest_queue", ["a", "b", "a", "b"]),
    ("random", [None, None, None, None]),
])
def test_the_other_methods(method, expect):
    router = two_schedulers(method=method)
    assert [router.route(SYSTEM, 0.1).scheduler_id for _ in range(4)] == expect


@pytest.mark.parametrize("kw,flag", [
    ({"method": "fastest"}, "--load-balance-method"),
    ({"cache_threshold": 1.5}, "--cache-threshold"),
    ({"balance_abs_threshold": -1}, "--balance-abs-threshold"),
    ({"balance_rel_threshold": 0.5}, "--balance-rel-threshold"),
])
def test_bad_routing_flags_are_refused_by_name(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Router(**kw)
