"""Which scheduler gets a request: the one that already holds its prefix, unless load says no.

Each scheduler publishes what enters and leaves its prefix cache (`KvEventsOut`, numbered
batches); the router keeps, per live scheduler, the set of block hashes it holds, names the
request's blocks with the engine's own hash (`common/block_hash.py`), and applies SGLang
router's rule:

    imbalanced = max_load - min_load > balance_abs_threshold
                 and max_load > min_load * balance_rel_threshold
    imbalanced                                  -> the least loaded scheduler   ("imbalance")
    best match / prompt tokens > cache_threshold -> the longest match            ("cache_hit")
    otherwise                                   -> the least loaded, most free KV ("cache_miss")

Load is a scheduler's running + waiting requests from its last heartbeat, plus what this
router sent it since. No NATS in here: the tokenizer service feeds it events, snapshots and
heartbeats, and asks it where each request goes.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from common.block_hash import prefix_block_hashes
from common.messages import AllBlocksCleared, BlockRemoved, KvEventsOut, KvSnapshotOut, StatsOut

METHODS = ("cache_aware", "round_robin", "shortest_queue", "random")


@dataclass
class SchedulerView:
    """One scheduler as this router sees it: the blocks it holds, its load."""

    scheduler_id: str
    last_heartbeat: float  # monotonic
    block_size: int = 0
    blocks: set[bytes] = field(default_factory=set)
    seq: int = 0  # the last event batch applied
    synced: bool = False  # `blocks` rests on a snapshot or an "all cleared", not on guesses
    snapshot_in_flight: bool = False
    buffered: list[KvEventsOut] = field(default_factory=list)  # arrived during a snapshot
    stats: StatsOut | None = None
    heartbeat_seq: int = 0  # the event batch the previous heartbeat said was the last one
    routed_since_heartbeat: int = 0

    @property
    def load(self) -> int:
        s = self.stats
        return (s.num_running + s.num_waiting if s else 0) + self.routed_since_heartbeat

    @property
    def free_blocks(self) -> int:
        return self.stats.kv_free_blocks if self.stats else 0

    def apply(self, batch: KvEventsOut) -> None:
        self.block_size = batch.block_size
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            else:
                self.blocks.update(event.block_hashes)
        self.seq = batch.seq

    def matched_blocks(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:  # chained hashes: the first miss ends the prefix
            if h not in self.blocks:
                break
            n += 1
        return n


@dataclass
class Route:
    scheduler_id: str | None  # None: any scheduler, through the queue group
    reason: str
    predicted_tokens: int | None = None  # prompt tokens expected to be cached there


class Router:
    def __init__(self, method: str = "cache_aware", cache_threshold: float = 0.3,
                 balance_abs_threshold: int = 64, balance_rel_threshold: float = 1.5,
                 heartbeat_timeout: float = 5.0) -> None:
        if method not in METHODS:
            raise ValueError(f"--load-balance-method {method!r}: choose from "
                             + ", ".join(METHODS))
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"--cache-threshold {cache_threshold}: must be within [0, 1]")
        if balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold {balance_abs_threshold}: must be >= 0")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"--balance-rel-threshold {balance_rel_threshold}: must be >= 1")
        self.method = method
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.heartbeat_timeout = heartbeat_timeout
        self.views: dict[str, SchedulerView] = {}
        self.decisions: Counter[str] = Counter()
        self.snapshots_total = 0
        self._turn = itertools.count()

    # -- what the schedulers say ----------------------------------------------------------------
    def _view(self, scheduler_id: str, now: float) -> SchedulerView:
        view = self.views.get(scheduler_id)
        if view is None:
            view = self.views[scheduler_id] = SchedulerView(scheduler_id, last_heartbeat=now)
        return view

    def on_events(self, batch: KvEventsOut, now: float) -> bool:
        """Apply one batch; True: events were missed, ask this scheduler for a snapshot."""
        view = self._view(batch.scheduler_id, now)
        if view.snapshot_in_flight:
            view.buffered.append(batch)
            return False
        if any(isinstance(e, AllBlocksCleared) for e in batch.events):
            view.apply(batch)  # a fresh start: what came before, seen or missed, is void
            view.synced = True
            return False
        if view.synced and batch.seq <= view.seq:
            return False  # already covered (a snapshot taken after it)
        if view.synced and batch.seq == view.seq + 1:
            view.apply(batch)
            return False
        view.buffered.append(batch)
        return True

    def snapshot_sent(self, scheduler_id: str) -> None:
        view = self.views.get(scheduler_id)
        if view is not None:
            view.snapshot_in_flight = True
            self.snapshots_total += 1

    def on_snapshot(self, snap: KvSnapshotOut | None, scheduler_id: str) -> bool:
        """A snapshot came back (None: it failed); True: still behind, ask again."""
        view = self.views.get(scheduler_id)
        if view is None:
            return False  # dropped meanwhile
        view.snapshot_in_flight = False
        if snap is None:
            view.synced = False  # the next heartbeat asks again
            return False
        view.blocks = set(snap.block_hashes)
        view.block_size = snap.block_size
        view.seq = snap.seq
        view.synced = True
        buffered, view.buffered = sorted(view.buffered, key=lambda b: b.seq), []
        for batch in buffered:
            if self.on_events(batch, view.last_heartbeat):
                view.buffered = []
                return True
        return False

    def on_heartbeat(self, stats: StatsOut, now: float) -> bool:
        """A scheduler's heartbeat; True: its view is behind, ask for a snapshot."""
        view = self._view(stats.instance_id, now)
        view.stats = stats
        view.last_heartbeat = now
        view.routed_since_heartbeat = 0
        # The previous heartbeat's batch has had a whole interval to arrive: still missing, it
        # (or the last of several) was lost. Comparing with this heartbeat's would race it.
        behind = not view.synced or view.seq < view.heartbeat_seq
        view.heartbeat_seq = stats.kv_events_seq
        return behind and not view.snapshot_in_flight

    def expire(self, now: float) -> list[str]:
        """Forget schedulers whose heartbeats stopped; returns their ids."""
        dead = [i for i, v in self.views.items() if now - v.last_heartbeat > self.heartbeat_timeout]
        for scheduler_id in dead:
            del self.views[scheduler_id]
        return dead

    def on_connection(self, up: bool, now: float) -> None:
        """Back on NATS: every scheduler's silence counts from now, not from before the cut
        (as `PeerTable.on_connection`); views that fell behind meanwhile catch up through
        the heartbeats' sequence numbers."""
        if up:
            for view in self.views.values():
                view.last_heartbeat = now

    def forget(self, scheduler_id: str) -> None:
        """It does not answer on its own subject: gone (a heartbeat brings it back)."""
        self.views.pop(scheduler_id, None)

    # -- the decision ---------------------------------------------------------------------------
    def route(self, tokens: list[int], now: float, salt: str | None = None,
              adapter: str | None = None) -> Route:
        live = sorted((v for v in self.views.values() if v.stats is not None
                       and now - v.last_heartbeat <= self.heartbeat_timeout),
                      key=lambda v: v.scheduler_id)
        if self.method == "random" or len(live) < 2:
            return self._decided(Route(None, "queue_group"))
        if self.method == "round_robin":
            view = live[next(self._turn) % len(live)]
            return self._chose(view, "round_robin")
        if self.method == "shortest_queue":
            return self._chose(min(live, key=lambda v: v.load), "shortest_queue")
        hashes: dict[int, list[bytes]] = {}  # per block size: schedulers normally share one

        def matched(view: SchedulerView) -> int:
            if not view.block_size:
                return 0
            if view.block_size not in hashes:
                hashes[view.block_size] = prefix_block_hashes(tokens, view.block_size, salt,
                                                               adapter)
            return view.matched_blocks(hashes[view.block_size]) * view.block_size

        loads = [v.load for v in live]
        if max(loads) - min(loads) > self.abs_threshold and \
                max(loads) > min(loads) * self.rel_threshold:
            view = min(live, key=lambda v: v.load)
            return self._chose(view, "imbalance", matched(view))
        match = {v.scheduler_id: matched(v) for v in live}
        best = max(live, key=lambda v: (match[v.scheduler_id], -v.load))
        if match[best.scheduler_id] / len(tokens) > self.cache_threshold:
            return self._chose(best, "cache_hit", match[best.scheduler_id])
        view = min(live, key=lambda v: (v.load, -v.free_blocks))
        return self._chose(view, "cache_miss", match[view.scheduler_id])

    def _chose(self, view: SchedulerView, reason: str, predicted: int | None = None) -> Route:
        view.routed_since_heartbeat += 1
        return self._decided(Route(view.scheduler_id, reason, predicted))

    def _decided(self, route: Route) -> Route:
        self.decisions[route.reason] += 1
        return route

    def fell_back(self, route: Route) -> Route:
        """The chosen scheduler did not answer: any scheduler takes it, through the queue group."""
        if route.scheduler_id is not None:
            self.forget(route.scheduler_id)
        return self._decided(Route(None, "fallback"))

    def view_sizes(self) -> dict[str, int]:
        return {i: len(v.blocks) for i, v in self.views.items()}
